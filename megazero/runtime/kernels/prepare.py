"""Resolving a run's kernels up front: which backend each op will use, with the extensions found, built or loaded
now rather than inside the first forward (`megazero.initialize` calls `prepare` before any process group or
collective exists, so a long build cannot outlast a peer's collective timeout).

Local to this process: no communication. Ranks of a node that build into one cache directory take turns on its
file lock (build.build_lock); the others then load what the first built.
"""
from __future__ import annotations

import torch

from . import build, loader

NORM_OPS = {"layernorm": "layer_norm", "rmsnorm": "rms_norm"}  # ModelSpec.norm -> op
SOFTMAX_OPS = ("scaled_masked_softmax", "scaled_upper_triang_masked_softmax")
APEX_MODULES = {"layer_norm": "apex.normalization.fused_layer_norm",
                "rms_norm": "apex.normalization.fused_layer_norm",
                "scaled_masked_softmax": "apex.transformer.functional.fused_softmax",
                "scaled_upper_triang_masked_softmax": "apex.transformer.functional.fused_softmax",
                "adam_step": "amp_C"}
# On CUDA without megazero's kernels or apex: torch's fused ops; the softmax has none, so its PyTorch twin.
CUDA_FALLBACK = {"layer_norm": "torch", "rms_norm": "torch", "scaled_masked_softmax": "reference",
                 "scaled_upper_triang_masked_softmax": "reference", "adam_step": "torch"}


def backend_of(op: str, device_type: str, device=None) -> str:
    """The backend `op` uses for the usual inputs (fp32/bf16/fp16, contiguous) on `device_type` ("cpu" or
    "cuda"), loading (building if needed) the extension that decides it: "megazero_cuda",
    "megazero_cpu_adam[<isa>]", "apex", "torch" (torch's fused op) or "reference" (the PyTorch twin; every op
    under MEGAZERO_KERNELS=reference)."""
    if op not in APEX_MODULES:
        raise ValueError(f"kernel op {op!r}; valid: {', '.join(APEX_MODULES)}")
    if loader.mode() == "reference":
        return "reference"
    if device_type == "cpu":
        ops = loader.cpu_adam() if op == "adam_step" else None
        return f"megazero_cpu_adam[{ops.best_isa()}]" if ops is not None else "reference"
    if device_type != "cuda":
        raise ValueError(f"device type {device_type!r}; valid: 'cpu', 'cuda'")
    if loader.cuda_ops(device) is not None:
        return "megazero_cuda"
    if loader.apex(APEX_MODULES[op]) is not None:
        return "apex"
    return CUDA_FALLBACK[op]


def prepare(device: torch.device, ops, adam_device: torch.device | None = None) -> dict[str, str]:
    """Load now every extension `ops` use on `device` (adam_step on `adam_device`, default `device`: the CPU
    under optimizer offload) and return {op: backend}. Builds for `device`'s GPU architecture; a failed build
    prints one line and falls back (MEGAZERO_KERNELS=strict raises). No communication."""
    device = torch.device(device)
    plan = {}
    for op in ops:
        where = torch.device(adam_device) if op == "adam_step" and adam_device is not None else device
        plan[op] = backend_of(op, where.type, where if where.type == "cuda" else None)
    return plan


def describe(plan: dict[str, str], device: torch.device) -> str:
    """One line naming each op's backend, e.g. "megazero kernels (cuda:0, sm_90): rms_norm=megazero_cuda, ..."."""
    device = torch.device(device)
    where = str(device)
    if device.type == "cuda":
        where += ", sm_" + "/".join(build.cuda_archs(device))
    return f"megazero kernels ({where}, MEGAZERO_KERNELS={loader.mode()}): " + ", ".join(
        f"{op}={backend}" for op, backend in plan.items())
