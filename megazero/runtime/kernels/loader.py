"""The kernel-load cache: each compiled extension (and apex) is found or built once per process: up front in
`megazero.initialize` (kernels/prepare.py), else on first use.

``MEGAZERO_KERNELS`` chooses the policy:
  auto       (default) use a built extension, else build it (JIT), else apex, else torch's fused ops on CUDA
             (F.layer_norm, F.rms_norm, torch's fused Adam) or the reference twin on CPU;
             a failed build prints one line and falls back.
  reference  never build or import anything: every op runs its PyTorch reference twin.
  strict     like auto, but a failed build raises KernelBuildError (CI, tools/gpu_check.sh).
"""
from __future__ import annotations

import importlib
import os
import re
import sys
import traceback
from types import ModuleType

from . import build

MODES = ("auto", "reference", "strict")

# The one module-level global megazero allows: extension/apex name -> loaded handle, or None after a failure.
_CACHE: dict[str, object] = {}


class KernelBuildError(RuntimeError):
    """A kernel extension could not be built or loaded (raised only with MEGAZERO_KERNELS=strict)."""


class MissingToolError(KernelBuildError):
    """The build was not tried: a compiler, ninja or the CUDA toolkit is missing."""


def mode() -> str:
    value = os.environ.get("MEGAZERO_KERNELS", "auto")
    if value not in MODES:
        raise ValueError(f"MEGAZERO_KERNELS={value!r}; valid: 'auto' (build, else fall back), "
                         f"'reference' (never build), 'strict' (a failed build raises)")
    return value


def _registered(spec: build.ExtSpec) -> object | None:
    """torch.ops.<name> if the library is already loaded in this process (e.g. by an earlier build)."""
    import torch

    ns = getattr(torch.ops, spec.name)
    probe = "best_isa" if spec is build.CPU_ADAM else "norm_fwd"
    try:
        getattr(ns, probe)
    except (AttributeError, RuntimeError):
        return None
    return ns


def _find_or_build(spec: build.ExtSpec, device) -> object:
    import torch

    ns = _registered(spec)
    if ns is not None:
        return ns
    lib = build.aot_library(spec)
    if lib is not None:
        torch.ops.load_library(str(lib))
    else:
        missing = build.missing_tools(spec)
        if missing:
            raise MissingToolError(missing)
        build.jit_build(spec, device=device)
    ns = _registered(spec)
    if ns is None:
        raise KernelBuildError(f"the library built for {spec.name} registered no ops")
    return ns


def _reason(err: BaseException) -> str:
    """The most telling line of a build failure: the first compiler diagnostic ("...: error: ..."), else the
    exception's first line."""
    text = str(err)
    for line in text.splitlines():
        if re.search(r"(^|\s|:)(fatal )?error\s*:", line, flags=re.IGNORECASE):
            return line.strip()[:300]
    first = text.splitlines()[0] if text else type(err).__name__
    return first.strip()[:300]


def _report(spec: build.ExtSpec, err: BaseException) -> None:
    log = build.cache_root() / f"{spec.name}-build-failure.log"
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("".join(traceback.format_exception(err)))
        where = f" Log: {log}."
    except OSError:
        where = ""
    what = "CUDA kernels" if spec.cuda else "CPU Adam kernel"
    if isinstance(err, MissingToolError):
        fix = ("install the CUDA toolkit matching torch.version.cuda and ninja" if spec.cuda
               else "install a C++ compiler and ninja (pip install ninja)")
    elif spec.cuda:
        fix = "use an nvcc that matches torch.version.cuda and a host compiler it supports; see the log"
    else:
        fix = "a compiler with C++17 and AVX-512 intrinsics is needed (gcc >= 9 or clang >= 10); see the log"
    instead = ("apex if installed, else torch's fused ops (F.layer_norm, F.rms_norm, fused AdamW; the softmax's "
               "PyTorch twin)" if spec.cuda else "the PyTorch reference")
    print(f"megazero.runtime.kernels: could not build the {what} ({spec.name}): {_reason(err)}. Using {instead} "
          f"instead. Fix: {fix}, or build ahead of time with MEGAZERO_BUILD_OPS=1 pip install "
          f"--no-build-isolation .; MEGAZERO_KERNELS=reference skips the build.{where}", file=sys.stderr, flush=True)


def extension(spec: build.ExtSpec, device=None) -> object | None:
    """torch.ops.<spec.name> with the extension loaded, building it on first use (a CUDA one for `device`'s
    architecture); None when unavailable."""
    if mode() == "reference":
        return None
    if spec.name not in _CACHE:
        try:
            _CACHE[spec.name] = _find_or_build(spec, device)
        except Exception as err:  # noqa: BLE001 - any build failure means: fall back, once, with one line
            _CACHE[spec.name] = None
            if mode() == "strict":
                raise KernelBuildError(f"building {spec.name} failed: {_reason(err)}") from err
            _report(spec, err)
    return _CACHE[spec.name]


def cpu_adam() -> object | None:
    """torch.ops.megazero_cpu_adam, or None."""
    return extension(build.CPU_ADAM)


def cuda_ops(device=None) -> object | None:
    """torch.ops.megazero_cuda built for `device` (default: the current CUDA device), or None (also None without
    a CUDA build of torch, quietly)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return extension(build.CUDA_OPS, torch.cuda.current_device() if device is None else device)


def apex(module: str) -> ModuleType | None:
    """An apex module (e.g. 'apex.normalization.fused_layer_norm', 'amp_C') if the user has apex, else None."""
    if mode() == "reference":
        return None
    key = f"apex:{module}"
    if key not in _CACHE:
        try:
            _CACHE[key] = importlib.import_module(module)
        except Exception:  # noqa: BLE001 - apex is optional; a broken install counts as absent
            _CACHE[key] = None
    return _CACHE[key]
