"""Scaled masked softmax and scaled causal softmax (Megatron's fused ops): megazero's CUDA kernels -> apex ->
the reference twin.

Tolerance against the twins (reference.scaled_masked_softmax / scaled_upper_triang_masked_softmax): outputs
reference.TOLERANCES["softmax"]; gradients TOLERANCES["softmax_backward"] against reference.softmax_backward
fed the output the kernel saved, which is in the input dtype (the twin's autograd keeps fp32). apex runs only
inside the limits its kernels were written for (fp16/bf16, 16 < sk <= 2048, sq and sk multiples of 8) and,
unlike the twin, gives fully masked rows a non-zero gradient. CPU tensors always use the twin.
"""
from __future__ import annotations

import torch

from . import loader, reference

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_APEX_SOFTMAX = "apex.transformer.functional.fused_softmax"


class _CudaSoftmax(torch.autograd.Function):
    """megazero_cuda.softmax_fwd / softmax_bwd on (batch, heads, sq, sk) scores."""

    @staticmethod
    def forward(ctx, scores, mask, scale, causal):
        y = loader.cuda_ops().softmax_fwd(scores.contiguous(), mask, scale, causal)
        ctx.save_for_backward(y, mask)
        ctx.scale, ctx.causal = scale, causal
        return y

    @staticmethod
    def backward(ctx, dy):
        y, mask = ctx.saved_tensors
        return loader.cuda_ops().softmax_bwd(dy.contiguous(), y, mask, ctx.scale, ctx.causal), None, None, None


def _kernel_mask_ok(scores: torch.Tensor, mask: torch.Tensor | None) -> bool:
    if mask is None:
        return True
    b, _, sq, sk = scores.shape
    return (mask.device == scores.device and mask.dtype in (torch.bool, torch.uint8) and mask.dim() == 4
            and mask.shape[0] in (1, b) and tuple(mask.shape[1:]) == (1, sq, sk))


def _apex_ok(scores: torch.Tensor) -> bool:
    sq, sk = scores.shape[-2:]
    return scores.dtype in (torch.float16, torch.bfloat16) and 16 < sk <= 2048 and sq % 8 == 0 and sk % 8 == 0


def backend(scores: torch.Tensor, mask: torch.Tensor | None = None, causal: bool = False) -> str:
    """Which implementation the (causal, or masked) softmax uses for these tensors."""
    if not scores.is_cuda or scores.dim() != 4 or scores.dtype not in _DTYPES:
        return "reference"
    if (causal or _kernel_mask_ok(scores, mask)) and loader.cuda_ops() is not None:
        return "megazero_cuda"
    if _apex_ok(scores) and (causal or _kernel_mask_ok(scores, mask) and mask is not None):
        if loader.apex(_APEX_SOFTMAX) is not None:
            return "apex"
    return "reference"


def scaled_masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax(scale * scores, -1) with masked entries (mask True) at -10000; see reference.scaled_masked_softmax.

    scores (batch, heads, sq, sk); mask (batch or 1, 1, sq, sk) bool, or None. Other shapes that broadcast
    run on the twin.
    """
    if mask is not None and mask.dtype not in (torch.bool, torch.uint8):
        raise ValueError(f"scaled_masked_softmax: mask has dtype {mask.dtype}; valid: torch.bool or torch.uint8")
    which = backend(scores, mask, causal=False)
    if which == "megazero_cuda":
        return _CudaSoftmax.apply(scores, None if mask is None else mask.contiguous(), float(scale), False)
    if which == "apex":
        return loader.apex(_APEX_SOFTMAX).scaled_masked_softmax(scores, mask.bool(), scale)
    return reference.scaled_masked_softmax(scores, mask, scale)


def scaled_upper_triang_masked_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax(scale * scores, -1): entries with j > i are excluded. scores (..., sq, sk) with sq == sk."""
    if scores.dim() < 2 or scores.shape[-1] != scores.shape[-2]:
        raise ValueError(f"scaled_upper_triang_masked_softmax: scores must be (..., sq, sk) with sq == sk, got "
                         f"{tuple(scores.shape)}")
    sq, sk = scores.shape[-2:]
    scores4 = scores.reshape(-1, 1, sq, sk)  # (batch * heads, 1, sq, sk)
    which = backend(scores4, None, causal=True)
    if which == "megazero_cuda":
        return _CudaSoftmax.apply(scores4, None, float(scale), True).view(scores.shape)
    if which == "apex":
        return loader.apex(_APEX_SOFTMAX).scaled_upper_triang_masked_softmax(scores4, None, scale).view(scores.shape)
    return reference.scaled_upper_triang_masked_softmax(scores, scale)
