"""Building megazero's C++/CUDA kernels: JIT on first use, or ahead of time with
``MEGAZERO_BUILD_OPS=1 pip install --no-build-isolation .`` (setup.py needs the installed torch to build).

Two extensions, each a torch op library (no Python module; ops appear under ``torch.ops.<name>``):

- ``megazero_cpu_adam``: csrc/cpu_adam (C++ with run-time AVX-512/AVX2/scalar choice, OpenMP).
- ``megazero_cuda``: csrc/cuda (LayerNorm/RMSNorm, scaled masked softmax, multi-tensor Adam); needs a CUDA
  build of torch and nvcc.

JIT builds go through torch.utils.cpp_extension (ninja) into a cache directory keyed by torch version, Python
version, C++ compiler and the sources (`sources_hash`), and for the CUDA extension also by the GPU architectures
it is built for (`cuda_archs`) and the nvcc version (`build_key`), so an upgrade of any of them, or a node with
another GPU, builds afresh. The JIT and the ahead-of-time build both pass -gencode flags for exactly those
architectures. Processes that build into one directory take turns on an flock-ed file there (`build_lock`):
the first builds, the others wait (at most `MEGAZERO_KERNEL_BUILD_TIMEOUT_S`, default 3600 s) and then load
what it built. Nothing here runs at import time.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent  # megazero/runtime/kernels/
CSRC = KERNELS_DIR / "csrc"
REPO_ROOT = KERNELS_DIR.parents[2]  # the directory holding megazero/
INCLUDE = CSRC / "include"


@dataclass(frozen=True)
class ExtSpec:
    """One extension: its torch library namespace (also the .so name) and its sources under csrc/."""

    name: str
    sources: tuple[str, ...]
    cuda: bool

    def source_paths(self) -> list[Path]:
        return [CSRC / s for s in self.sources]


CPU_ADAM = ExtSpec("megazero_cpu_adam", ("cpu_adam/cpu_adam.cpp", "cpu_adam/cpu_adam_avx2.cpp",
                                         "cpu_adam/cpu_adam_avx512.cpp", "cpu_adam/bindings.cpp"), cuda=False)
CUDA_OPS = ExtSpec("megazero_cuda", ("cuda/layer_norm.cu", "cuda/softmax.cu", "cuda/multi_tensor_adam.cu",
                                     "cuda/bindings.cpp"), cuda=True)
EXTENSIONS = (CPU_ADAM, CUDA_OPS)


def openmp_flags() -> list[str]:
    """-fopenmp where the toolchain has it (Linux gcc/clang); macOS' Apple clang does not, so no threads there."""
    return [] if sys.platform == "darwin" else ["-fopenmp"]


def cxx_flags() -> list[str]:
    # -ffp-contract=off: the compiler must not fuse a*b+c on its own; the kernels place every fma explicitly so
    # the scalar, AVX2, AVX-512 and CUDA paths agree bit for bit. No -march=native: ISA choice is at run time.
    return ["-O3", "-ffp-contract=off", "-fno-math-errno", *openmp_flags()]


def nvcc_flags() -> list[str]:
    # No --use_fast_math: the Adam update relies on correctly rounded sqrt and division.
    return ["-O3", "-std=c++17", "-lineinfo"]


DEFAULT_ARCHS = ("80", "90")  # A100; H100/H200


def cuda_arch_flags(archs: tuple[str, ...] = DEFAULT_ARCHS) -> list[str]:
    """-gencode flags for SM versions (default: A100 and H100/H200)."""
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]


def parse_arch_list(value: str) -> tuple[str, ...]:
    """TORCH_CUDA_ARCH_LIST ("8.0;9.0", "8.0 9.0+PTX", "90") as SM numbers ("80", "90"); "+PTX" is dropped
    (megazero builds cubins for the listed GPUs only)."""
    archs = []
    for item in value.replace(",", ";").replace(" ", ";").split(";"):
        item = item.strip().removesuffix("+PTX")
        if not item:
            continue
        digits = item.replace(".", "")
        if not digits.isdigit():
            raise ValueError(f"TORCH_CUDA_ARCH_LIST={value!r}: {item!r} is not a compute capability; expected "
                             f"entries like 8.0 or 9.0 separated by ';'")
        archs.append(digits)
    if not archs:
        raise ValueError(f"TORCH_CUDA_ARCH_LIST={value!r} names no architecture; expected e.g. '9.0' or '8.0;9.0'")
    return tuple(dict.fromkeys(archs))


def cuda_archs(device=None) -> tuple[str, ...]:
    """The SM versions the CUDA extension is built for: $TORCH_CUDA_ARCH_LIST if set, else `device`'s compute
    capability (e.g. ("90",) on an H200), else DEFAULT_ARCHS (an ahead-of-time build on a machine without a GPU)."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return parse_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    if device is not None:
        import torch

        major, minor = torch.cuda.get_device_capability(device)
        return (f"{major}{minor}",)
    return DEFAULT_ARCHS


def nvcc_version() -> str:
    """The release nvcc reports (e.g. "12.4.131" from "V12.4.131"), "missing" without nvcc."""
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = str(Path(CUDA_HOME) / "bin" / "nvcc") if CUDA_HOME else "nvcc"
    try:
        banner = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return "missing"
    for word in banner.split():
        if word.startswith("V") and word[1:2].isdigit():
            return word[1:]
    return hashlib.sha1(banner.encode()).hexdigest()[:8]


def compiler_id() -> str:
    """Short id of the C++ compiler ($CXX or c++): its name plus a hash of its --version banner."""
    cxx = os.environ.get("CXX", "c++")
    try:
        banner = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        banner = "missing"
    return f"{Path(cxx).name}-{hashlib.sha1(banner.encode()).hexdigest()[:8]}"


def cache_root() -> Path:
    """$MEGAZERO_CACHE_DIR, else $XDG_CACHE_HOME/megazero, else ~/.cache/megazero."""
    if os.environ.get("MEGAZERO_CACHE_DIR"):
        return Path(os.environ["MEGAZERO_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "megazero"


SOURCE_SUFFIXES = (".cpp", ".cu", ".h", ".cuh", ".hpp")


def sources_hash(spec: ExtSpec) -> str:
    """Short hash of what `spec` compiles: the location and bytes of every source and header in its sources'
    folders and under csrc/include. Two megazero versions (or checkouts) sharing a cache then build into
    separate directories instead of rebuilding, and overwriting, each other's library."""
    folders = sorted({p.parent for p in spec.source_paths()})
    files = [f for d in folders for f in sorted(d.iterdir()) if f.suffix in SOURCE_SUFFIXES]
    files += sorted(f for f in INCLUDE.rglob("*") if f.suffix in SOURCE_SUFFIXES)
    digest = hashlib.sha1()
    for f in files:
        digest.update(str(f).encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:10]


def build_key(spec: ExtSpec, device=None) -> str:
    """The cache directory name of `spec`'s build: torch version, Python, machine, C++ compiler and
    `sources_hash`; for the CUDA extension also torch's CUDA version, the nvcc release and the SM versions
    (`cuda_archs(device)`)."""
    import torch

    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    key = f"torch{torch.__version__}-{py}-{platform.machine()}-{compiler_id()}-src{sources_hash(spec)}"
    if spec.cuda:
        key += f"-cu{torch.version.cuda}-nvcc{nvcc_version()}-sm{'_'.join(cuda_archs(device))}"
    return key.replace("+", "_")


def build_dir(spec: ExtSpec, device=None) -> Path:
    return cache_root() / "ext" / build_key(spec, device) / spec.name


def build_timeout_s() -> float:
    """$MEGAZERO_KERNEL_BUILD_TIMEOUT_S (default 3600): how long a process waits for another's build."""
    raw = os.environ.get("MEGAZERO_KERNEL_BUILD_TIMEOUT_S", "3600")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"MEGAZERO_KERNEL_BUILD_TIMEOUT_S={raw!r}; expected a positive number of seconds")
    return value


@contextlib.contextmanager
def build_lock(directory: Path, timeout_s: float, poll_s: float = 0.2) -> Iterator[None]:
    """Hold an exclusive flock on `directory`/megazero.lock: one process per build directory compiles at a time
    (the ranks of a node share one cache). The kernel drops the lock when its holder dies, so no stale lock
    survives a killed build; torch's own lock file, which does, is removed while the flock is held. Waits at most
    `timeout_s`, then raises TimeoutError naming the directory. No communication between ranks."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "megazero.lock", "a+") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited {timeout_s:.0f} s for another process' kernel build in {directory} "
                                       f"(MEGAZERO_KERNEL_BUILD_TIMEOUT_S); if no build is running, the file "
                                       f"system may not support flock: set MEGAZERO_CACHE_DIR to a local "
                                       f"disk") from None
                time.sleep(poll_s)
        try:
            (directory / "lock").unlink(missing_ok=True)  # torch's FileBaton, left by a killed build
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def missing_tools(spec: ExtSpec) -> str | None:
    """A sentence naming what the build of `spec` lacks before trying it, or None when nothing is missing."""
    import torch

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"the C++ compiler {cxx!r} was not found (set CXX or put c++ on PATH)"
    if shutil.which("ninja") is None:
        return "ninja is not installed"
    if spec.cuda:
        from torch.utils.cpp_extension import CUDA_HOME

        if torch.version.cuda is None:
            return f"torch {torch.__version__} is a CPU build"
        if CUDA_HOME is None:
            return "the CUDA toolkit (nvcc) was not found; set CUDA_HOME"
    return None


def aot_library(spec: ExtSpec) -> Path | None:
    """The library built by ``MEGAZERO_BUILD_OPS=1 pip install --no-build-isolation .``, if there is one."""
    found = sorted(KERNELS_DIR.glob(f"_{spec.name}*.so"))
    return found[0] if found else None


def jit_build(spec: ExtSpec, verbose: bool = False, device=None) -> Path:
    """Compile `spec` (incrementally) for `device`'s architecture (CUDA) and load it into torch.ops, holding the
    build directory's lock; returns the library path. Raises on failure."""
    from torch.utils import cpp_extension

    out = build_dir(spec, device)
    kwargs = dict(extra_cflags=cxx_flags(), extra_ldflags=openmp_flags(), extra_include_paths=[str(INCLUDE)])
    if spec.cuda:  # explicit -gencode flags: torch then adds none of its own
        kwargs.update(extra_cflags=["-O3"], extra_ldflags=[],
                      extra_cuda_cflags=[*nvcc_flags(), *cuda_arch_flags(cuda_archs(device))])
    with build_lock(out, build_timeout_s()):
        # With is_python_module=False, load() also loads the library into the process (its ops into torch.ops).
        lib = cpp_extension.load(spec.name, [str(p) for p in spec.source_paths()], build_directory=str(out),
                                 is_python_module=False, verbose=verbose, **kwargs)
    return Path(lib) if isinstance(lib, (str, os.PathLike)) else out / f"{spec.name}.so"


def aot_nvcc_flags() -> list[str]:
    """nvcc flags of the ahead-of-time CUDA build: nvcc_flags() and -gencode for `cuda_archs()`
    ($TORCH_CUDA_ARCH_LIST, else sm_80 and sm_90)."""
    return [*nvcc_flags(), *cuda_arch_flags(cuda_archs())]


def aot_extensions():
    """(ext_modules, cmdclass) for setup.py: the CPU Adam always, the CUDA ops when torch and nvcc have CUDA."""
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    root = REPO_ROOT

    def rel(spec: ExtSpec) -> list[str]:
        return [str(p.relative_to(root)) for p in spec.source_paths()]

    include = [str(INCLUDE)]  # absolute: ninja compiles from the build directory
    exts = [CppExtension(f"megazero.runtime.kernels._{CPU_ADAM.name}", rel(CPU_ADAM), include_dirs=include,
                         extra_compile_args={"cxx": cxx_flags()}, extra_link_args=openmp_flags())]
    if torch.version.cuda is not None and CUDA_HOME is not None:
        exts.append(CUDAExtension(f"megazero.runtime.kernels._{CUDA_OPS.name}", rel(CUDA_OPS), include_dirs=include,
                                  extra_compile_args={"cxx": ["-O3"], "nvcc": aot_nvcc_flags()}))
    else:
        print(f"megazero: MEGAZERO_BUILD_OPS=1 builds the CPU Adam only (torch {torch.__version__} "
              f"cuda={torch.version.cuda}, CUDA_HOME={CUDA_HOME}); CUDA kernels will use apex or torch's fused ops.")
    return exts, {"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)}
