"""megazero.runtime.kernels: the dispatch point for fused kernels. The rest of megazero calls only this module.

Each op runs, in order of preference: megazero's built extension (csrc/: loaded, or built, by megazero.initialize
before any collective (prepare.py), else on first use; or built ahead of time with MEGAZERO_BUILD_OPS=1) -> NVIDIA
apex if the user has it -> on CUDA torch's fused op, on CPU the PyTorch reference twin
(megazero.runtime.kernels.reference), which is the op's specification. Importing this package compiles nothing.
MEGAZERO_KERNELS=reference forces the twins; =strict turns a failed build into an error (see loader).

    layer_norm(x, weight, bias=None, eps=1e-5)          rms_norm(x, weight, eps=1e-5)
    scaled_masked_softmax(scores, mask, scale)          scaled_upper_triang_masked_softmax(scores, scale)
    adam_step(param, grad, exp_avg, exp_avg_sq, *, step, lr, ...)      CPUAdam(params, lr=1e-3, ...)
    kernel_info()  -> which backend each op uses, per device type
    prepare.prepare(device, ops) -> load a run's kernels up front (megazero.initialize), {op: backend}

On CUDA a failed build falls back to apex if present, else to torch's fused ops (F.layer_norm, F.rms_norm,
torch's fused AdamW; the softmax, which torch has no fused op for, to its twin); the twins stay the CPU path.
"""
from __future__ import annotations

from .adam import CPUAdam, adam_step
from .norm import layer_norm, rms_norm
from .softmax import scaled_masked_softmax, scaled_upper_triang_masked_softmax

__all__ = ["CPUAdam", "adam_step", "kernel_info", "layer_norm", "rms_norm", "scaled_masked_softmax",
           "scaled_upper_triang_masked_softmax"]

OPS = ("layer_norm", "rms_norm", "scaled_masked_softmax", "scaled_upper_triang_masked_softmax", "adam_step")


def kernel_info() -> dict:
    """{"mode": ..., "cpu": {op: backend}, "cuda": {op: backend}} for inputs each kernel takes.

    Loads (and if needed builds) the extensions, as the first real call would. Backends: "megazero_cuda",
    "megazero_cpu_adam[<isa>]", "apex", "torch", "reference", or "unavailable (...)" on the CUDA side without
    a device.
    """
    import torch

    from . import loader, prepare

    cpu = {op: prepare.backend_of(op, "cpu") for op in OPS}
    if not torch.cuda.is_available():
        cuda = {op: "unavailable (no CUDA device)" for op in OPS}
    else:
        cuda = {op: prepare.backend_of(op, "cuda") for op in OPS}
    return {"mode": loader.mode(), "cpu": cpu, "cuda": cuda}
