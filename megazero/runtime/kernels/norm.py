"""LayerNorm and RMSNorm: megazero's CUDA kernels -> apex -> torch's own (F.layer_norm / F.rms_norm) on CUDA;
the reference twin on CPU and for inputs none of them takes.

Tolerance of the kernels against the twins (reference.layer_norm / reference.rms_norm), outputs and gradients:
reference.TOLERANCES["layer_norm"] / ["rms_norm"]. Statistics are fp32 for every input dtype; weight (and bias)
may be x's dtype or fp32; outputs have x's dtype. CPU tensors always use the twin.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import loader, reference

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_APEX_NORM = "apex.normalization.fused_layer_norm"


class _CudaNorm(torch.autograd.Function):
    """megazero_cuda.norm_fwd / norm_bwd over x viewed as (rows, weight.numel())."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        ops = loader.cuda_ops()
        x2 = x.contiguous().view(-1, weight.numel())  # (rows, cols)
        y, mean, rstd = ops.norm_fwd(x2, weight.contiguous(), None if bias is None else bias.contiguous(), eps, rms)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.rms, ctx.has_bias = rms, bias is not None
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = loader.cuda_ops().norm_bwd(dy.contiguous().view(x2.shape), x2, weight.contiguous(), mean, rstd,
                                                ctx.rms, ctx.has_bias)
        return dx.view(dy.shape), dw.view(weight.shape), db.view(weight.shape) if ctx.has_bias else None, None, None


def _check(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dim() == 0 or tuple(x.shape[x.dim() - weight.dim():]) != tuple(weight.shape):
        raise ValueError(f"{op}: weight shape {tuple(weight.shape)} must equal the trailing dims of x "
                         f"{tuple(x.shape)}")
    if bias is not None and bias.shape != weight.shape:
        raise ValueError(f"{op}: bias shape {tuple(bias.shape)} must equal weight shape {tuple(weight.shape)}")


def backend(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, rms: bool = False) -> str:
    """Which implementation layer_norm (rms=False) or rms_norm (rms=True) uses for these tensors."""
    if not x.is_cuda:
        return "reference"
    same_device = weight.device == x.device and (bias is None or bias.device == x.device)
    kernel_ok = (same_device and x.dtype in _DTYPES and weight.dtype in (x.dtype, torch.float32)
                 and (bias is None or bias.dtype == weight.dtype) and weight.numel() > 0)
    if kernel_ok and loader.cuda_ops() is not None:
        return "megazero_cuda"
    apex_ok = same_device and x.dtype in _DTYPES and weight.dtype == x.dtype and (rms or bias is not None)
    if apex_ok and loader.apex(_APEX_NORM) is not None:
        return "apex"
    torch_ok = loader.mode() != "reference" and same_device and (bias is None or bias.dtype == weight.dtype) and (
        weight.dtype == x.dtype or (x.dtype in _DTYPES and weight.dtype == torch.float32))
    return "torch" if torch_ok else "reference"


def torch_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The CUDA fallback: torch's fused LayerNorm (fp32 statistics; an fp32 weight with a 16-bit x is allowed)."""
    return F.layer_norm(x, tuple(weight.shape), weight, bias, eps).to(x.dtype)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The CUDA fallback: torch's RMSNorm (its fused CUDA kernel where torch has one), output in x's dtype."""
    return F.rms_norm(x, tuple(weight.shape), weight, eps).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the trailing ``weight.shape`` dims of x (see reference.layer_norm)."""
    _check("layer_norm", x, weight, bias)
    which = backend(x, weight, bias, rms=False)
    if which == "megazero_cuda":
        return _CudaNorm.apply(x, weight, bias, eps, False)
    if which == "apex":
        return loader.apex(_APEX_NORM).fused_layer_norm_affine(x, weight, bias, weight.shape, eps)
    if which == "torch":
        return torch_layer_norm(x, weight, bias, eps)
    return reference.layer_norm(x, weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm over the trailing ``weight.shape`` dims of x (see reference.rms_norm)."""
    _check("rms_norm", x, weight, None)
    which = backend(x, weight, None, rms=True)
    if which == "megazero_cuda":
        return _CudaNorm.apply(x, weight, None, eps, True)
    if which == "apex":
        return loader.apex(_APEX_NORM).fused_rms_norm_affine(x, weight, weight.shape, eps)
    if which == "torch":
        return torch_rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)
