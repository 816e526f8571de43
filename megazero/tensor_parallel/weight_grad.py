"""Deferred weight gradients for zero-bubble pipeline schedules (Qi et al., ICLR 2024).

A linear layer's backward has two GEMMs: the input gradient (gx = gy·W, on the critical path:
the previous stage waits for it) and the weight gradient (gW = gyᵀ·x, needed only by the
optimizer). Zero-bubble schedules run the first in B and the second later in W, filling the
pipeline's cool-down bubble. While a `WeightGradStore` is `deferring`, every linear layer that
holds it computes only gx (and its bias gradient) and leaves (weight, x, gy) in the store; W runs
`compute(entry)` for each. No communication.

The store is an object the pipeline engine creates per stage and hands to the stage's layers
(`attach(module, store)`), never a global.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


class WeightGradStore:
    def __init__(self):
        self.deferring = False
        self._pending: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] = []

    @contextlib.contextmanager
    def defer(self):
        """Within the block, linear layers holding this store defer their weight-gradient GEMMs."""
        self.deferring = True
        try:
            yield self
        finally:
            self.deferring = False

    def push(self, weight, x, grad_out) -> None:
        self._pending.append((weight, x, grad_out))

    def take(self) -> list:
        """The deferred (weight, input, output-grad) triples since the last take."""
        out, self._pending = self._pending, []
        return out

    @staticmethod
    def compute(entry) -> tuple[torch.nn.Parameter, torch.Tensor]:
        """(weight, its gradient) of one deferred GEMM: gW = gyᵀ·x over all leading dims."""
        weight, x, gy = entry
        return weight, gy.reshape(-1, gy.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))  # (out, in)


class _DeferrableLinear(torch.autograd.Function):
    """y = x·Wᵀ (+ b); backward defers gW to the store while it is deferring."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        # the weight is kept as the Parameter itself (not a saved tensor): saved-tensor hooks
        # (checkpointing, the memory meter) would hand back a plain tensor, and W must name the
        # parameter it accumulates into
        ctx.save_for_backward(x)
        ctx.weight, ctx.has_bias, ctx.store = weight, bias is not None, store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        (x,), weight = ctx.saved_tensors, ctx.weight
        gx = gy.matmul(weight)  # (..., in)
        gb = gy.reshape(-1, gy.shape[-1]).sum(0) if ctx.has_bias else None
        if ctx.store.deferring:
            ctx.store.push(weight, x, gy)
            gw = None
        else:
            gw = gy.reshape(-1, gy.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
        return gx, gw, gb, None


def linear(x, weight, bias=None, store: WeightGradStore | None = None):
    """F.linear, or its deferrable twin when a store is attached."""
    if store is None:
        return F.linear(x, weight, bias)
    return _DeferrableLinear.apply(x, weight, bias, store)


def attach(module: torch.nn.Module, store: WeightGradStore | None) -> int:
    """Give `store` to every layer of `module` that can defer (has a `wgrad_store` attribute);
    returns how many."""
    n = 0
    for m in module.modules():
        if hasattr(m, "wgrad_store"):
            m.wgrad_store = store
            n += 1
    return n
