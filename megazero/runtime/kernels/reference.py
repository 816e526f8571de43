"""PyTorch reference twins of megazero's fused kernels (L0: plain torch ops, autograd-correct on any device).

Each twin is the specification of its kernel: the CUDA and C++ kernels compute the same function, and
TOLERANCES says how far a kernel may be from its twin (elementwise ``|k - t| <= atol + rtol * |t|``).
Mixed-precision inputs (bf16/fp16) are computed in fp32 and rounded to the input dtype once, as the kernels do.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Megatron-LM's fill value for masked attention scores (finite, so a fully masked row is uniform, not NaN).
MASKED_SCORE = -10000.0

# (rtol, atol) of kernel vs twin per output dtype. The fp32 rows bound reduction-order differences; the 16-bit
# rows are about one unit in the last place of the output dtype (kernels round once, twins may round twice).
# adam: atol is relative to the tensor's scale (max |t|), after 100 steps, against this twin and against
# torch.optim.AdamW(foreach=False). The kernels follow torch's op order except for a fused denom (see
# adam_step); with torch's own sqrt being 1 ulp off on vectorised CPU builds, differences stay near 1e-7.
TOLERANCES = {
    "layer_norm": {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)},
    "rms_norm": {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)},
    "softmax": {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1.6e-2, 1e-3), torch.float16: (2e-3, 1e-4)},
    # softmax gradients against softmax_backward() fed the output the kernel saved (16-bit y for 16-bit input;
    # the twin's autograd keeps fp32 y, whose rounding the forward tolerance above already covers)
    "softmax_backward": {torch.float32: (1e-5, 1e-6), torch.bfloat16: (8e-3, 1e-5), torch.float16: (1e-3, 1e-5)},
    "adam": {torch.float32: (1e-6, 1e-6)},
}


def _norm_dims(weight: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(-weight.dim(), 0))


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for 16-bit and fp32 inputs; float64 stays float64."""
    return torch.promote_types(x.dtype, torch.float32)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the trailing ``weight.shape`` dims: (x - mean) / sqrt(var + eps) * weight + bias.

    Biased variance, statistics in fp32 (float64 for float64 x); the result has x's dtype.
    """
    dt = _math_dtype(x)
    y = F.layer_norm(x.to(dt), tuple(weight.shape), weight.to(dt), None if bias is None else bias.to(dt), eps)
    return y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm over the trailing ``weight.shape`` dims: x / sqrt(mean(x^2) + eps) * weight, in fp32."""
    dt = _math_dtype(x)
    xf = x.to(dt)
    rstd = torch.rsqrt(xf.square().mean(_norm_dims(weight), keepdim=True) + eps)
    return (xf * rstd * weight.to(dt)).to(x.dtype)


def scaled_masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax(scale * scores) along the last dim, with masked entries (mask True) set to -10000 first.

    mask broadcasts against scores, e.g. (batch or 1, 1, sq, sk) for scores (batch, heads, sq, sk).
    Computed in fp32; the result has scores' dtype. Masked entries get no gradient.
    """
    z = scores.to(_math_dtype(scores)) * scale
    if mask is not None:
        z = z.masked_fill(mask.bool(), MASKED_SCORE)
    return torch.softmax(z, dim=-1).to(scores.dtype)


def causal_mask(sq: int, sk: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(sq, sk) bool, True above the diagonal (j > i): the entries a causal softmax drops."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)


def scaled_upper_triang_masked_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax(scale * scores) along the last dim: entry (i, j) with j > i is excluded (output 0).

    scores (..., sq, sk) with sq == sk. Computed in fp32; the result has scores' dtype.
    """
    sq, sk = scores.shape[-2:]
    z = (scores.to(_math_dtype(scores)) * scale).masked_fill(causal_mask(sq, sk, scores.device), float("-inf"))
    return torch.softmax(z, dim=-1).to(scores.dtype)


def softmax_backward(y: torch.Tensor, dy: torch.Tensor, masked: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Gradient of the (masked / causal) scaled softmax given its output y: scale * y * (dy - sum(dy * y)),
    0 where masked (masked broadcasts against y; True = masked). In float64; the result has y's dtype."""
    y64, dy64 = y.double(), dy.double()
    dx = scale * y64 * (dy64 - (dy64 * y64).sum(-1, keepdim=True))
    if masked is not None:
        dx = dx.masked_fill(masked.bool(), 0.0)
    return dx.to(y.dtype)


@torch.no_grad()
def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
              step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
              adamw_mode: bool, bias_correction: bool, maximize: bool = False,
              param_copy: torch.Tensor | None = None) -> None:
    """One Adam (adamw_mode=False: L2 added to the gradient) or AdamW (decoupled decay) step, in place.

    The same operations in the same order as the kernels (csrc/include/megazero/adam_math.h), which follow
    torch.optim.AdamW(foreach=False) except that denom = sqrt(v) * (1 / sqrt(bc2)) + eps. Works in param's
    dtype; grad is cast to it. param_copy, when given,
    receives param rounded to its dtype.
    """
    grad_t = grad.to(param.dtype)  # the paper's g_t
    if maximize:
        grad_t = -grad_t
    if weight_decay != 0 and not adamw_mode:
        grad_t = grad_t.add(param, alpha=weight_decay)
    if weight_decay != 0 and adamw_mode:
        param.mul_(1 - lr * weight_decay)
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = 1 - beta2 ** step if bias_correction else 1.0
    exp_avg.lerp_(grad_t, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad_t, grad_t, value=1 - beta2)
    denom = exp_avg_sq.sqrt().mul_(1 / math.sqrt(bc2)).add_(eps)  # the kernels fuse this mul and add
    param.addcdiv_(exp_avg, denom, value=-(lr / bc1))
    if param_copy is not None:
        param_copy.copy_(param)


def sgd_step(p, grad, buf, lr, momentum, weight_decay, first):
    """SGD with optional momentum, in place (torch.optim.SGD semantics, dampening 0): the ZeRO
    optimizer's update rule for optimizer.type sgd (no fused kernel: one pass of torch ops)."""
    d = grad + weight_decay * p if weight_decay else grad
    if momentum:
        if first:
            buf.copy_(d)
        else:
            buf.mul_(momentum).add_(d)
        d = buf
    p.add_(d, alpha=-lr)
