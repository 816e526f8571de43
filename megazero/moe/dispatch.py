"""Moving routed tokens to the ranks that hold their experts and back, over the expert-parallel group.

With E experts over an ep group of P ranks, rank r holds experts ``r·E/P .. (r+1)·E/P − 1``. A rank's
kept assignments, sorted by expert, are one block of rows per destination rank; `exchange_counts`
tells each rank how many rows of each of its local experts every source sends; `AllToAll` moves the
rows (its backward moves the gradients the other way: the same volume again).
"""
from __future__ import annotations

import torch

from megazero.runtime import comm
from megazero.runtime.comm import GroupHandle


class AllToAll(torch.autograd.Function):
    """All-to-all of rows over `group`: forward sends ``input_splits[j]`` rows to rank j and receives
    ``output_splits[j]`` from it; backward sends the gradients back along the same splits."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group: GroupHandle):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = rows.new_empty((sum(output_splits),) + tuple(rows.shape[1:]))
        comm.all_to_all_single(out, rows.contiguous(), group, output_splits, input_splits)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits),) + tuple(grad.shape[1:]))
        comm.all_to_all_single(back, grad.contiguous(), ctx.group, input_splits, output_splits)
        return back, None, None, None


def exchange_counts(counts: torch.Tensor, group: GroupHandle) -> torch.Tensor:
    """`counts` (E,): this rank's rows for each expert. Returns (P, E/P): the rows each source rank
    sends for each of this rank's experts (one all-to-all of E/P integers per peer)."""
    per_rank = counts.view(group.size, -1)  # (P, E/P): rows for each destination's local experts
    received = torch.empty_like(per_rank)
    comm.all_to_all_single(received, per_rank, group)
    return received


__all__ = ["AllToAll", "exchange_counts"]
