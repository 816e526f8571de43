"""Building megazero's C++/CUDA kernels: JIT on first use, or ahead of time with
``MEGAZERO_BUILD_OPS=1 pip install --no-build-isolation .`` (setup.py needs the installed torch to build).

Two extensions, each a torch op library (no Python module; ops appear under ``torch.ops.<name>``):

- ``megazero_cpu_adam``: csrc/cpu_adam (C++ with run-time AVX-512/AVX2/scalar choice, OpenMP).
- ``megazero_cuda``: csrc/cuda (LayerNorm/RMSNorm, scaled masked softmax, multi-tensor Adam); needs a CUDA
  build of torch and nvcc.

JIT builds go through torch.utils.cpp_extension (ninja) into a cache directory keyed by torch version,
Python version and compiler, so an upgrade of any of them builds afresh and rebuilds are incremental.
Nothing here runs at import time.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
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


def cuda_arch_flags(archs: tuple[str, ...] = ("80", "90")) -> list[str]:
    """-gencode flags for SM versions (default: A100 and H100/H200)."""
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]


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


def build_dir(spec: ExtSpec) -> Path:
    import torch

    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    key = f"torch{torch.__version__}-{py}-{platform.machine()}-{compiler_id()}"
    return cache_root() / "ext" / key.replace("+", "_") / spec.name


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


def jit_build(spec: ExtSpec, verbose: bool = False) -> Path:
    """Compile `spec` (incrementally) and load it into torch.ops; returns the library path. Raises on failure."""
    from torch.utils import cpp_extension

    out = build_dir(spec)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = dict(extra_cflags=cxx_flags(), extra_ldflags=openmp_flags(), extra_include_paths=[str(INCLUDE)])
    if spec.cuda:
        kwargs.update(extra_cflags=["-O3"], extra_ldflags=[], extra_cuda_cflags=nvcc_flags())
    # With is_python_module=False, load() also loads the library into the process (its ops into torch.ops).
    lib = cpp_extension.load(spec.name, [str(p) for p in spec.source_paths()], build_directory=str(out),
                             is_python_module=False, verbose=verbose, **kwargs)
    return Path(lib) if isinstance(lib, (str, os.PathLike)) else out / f"{spec.name}.so"


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
                                  extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc_flags()}))
    else:
        print(f"megazero: MEGAZERO_BUILD_OPS=1 builds the CPU Adam only (torch {torch.__version__} "
              f"cuda={torch.version.cuda}, CUDA_HOME={CUDA_HOME}); CUDA kernels will use apex or the reference.")
    return exts, {"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)}
