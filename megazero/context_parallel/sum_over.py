"""A sum over the cp group that every rank then uses alike, with its gradient: what a per-sequence quantity
(an MoE layer's mean router probability per expert) needs when each cp rank holds part of the sequence."""
from __future__ import annotations

import torch

from megazero.runtime import comm


class SumOverGroup(torch.autograd.Function):
    """Forward: the sum of every member's `x` over `group` (all-reduce). Backward: the sum of every member's
    gradient (all-reduce): each member computes the same loss from the same sum, and the data-parallel
    gradient average divides by the group's size again, so each member's part gets the loss's own gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: comm.GroupHandle) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        comm.all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, ctx.group)
        return grad, None


def sum_over(x: torch.Tensor, group: comm.GroupHandle | None) -> torch.Tensor:
    """`x` summed over `group` (None or one rank: `x`), differentiably (`SumOverGroup`)."""
    if group is None or group.size == 1:
        return x
    return SumOverGroup.apply(x, group)
