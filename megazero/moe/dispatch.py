"""Moving routed tokens to the ranks that hold their experts and back, over the expert-parallel group.

With E experts over an ep group of P ranks, rank r holds experts ``r·E/P .. (r+1)·E/P − 1``. A rank's
kept assignments, sorted by expert, are one block of rows per destination rank; `exchange_counts`
tells each rank how many rows of each of its local experts every source sends; `AllToAll` moves the
rows (its backward moves the gradients the other way: the same volume again). `plan_dispatch` makes
the `DispatchPlan` of a micro-batch: with one ep rank without any host synchronisation, with more
with exactly one (the all-to-all's split sizes, which the host must pass to the collective).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megazero.moe.routing import Decision
from megazero.runtime import comm
from megazero.runtime.comm import GroupHandle


@dataclass
class DispatchPlan:
    """A micro-batch's routing decision and where its rows go; made once per forward, an activation
    recompute replays it (`megazero.moe.layer.MoELayer`), host values included: no second sync.

    `decision`: experts and kept assignments; `token`, `slot` (n,): the assignment of each row, its token
    and its place among the token's k, sorted by expert (stable: token-major within one expert). With
    one ep rank every one of the b·s·k assignments, the dropped ones last (n = b·s·k: their rows run
    through no expert); with P > 1 the kept ones only (n = Σ sends). `counts` (E,) int64: kept rows
    per expert. With P > 1: `received` (P, E/P): the rows each source sends for each local expert;
    `sends`, `recvs` (P ints): rows to and from each ep rank; `local` (E/P ints): rows each local
    expert runs (all on the host); None with one ep rank."""

    decision: Decision
    token: torch.Tensor
    slot: torch.Tensor
    counts: torch.Tensor
    received: torch.Tensor | None = None
    sends: list[int] | None = None
    recvs: list[int] | None = None
    local: list[int] | None = None


@torch.no_grad()
def plan_dispatch(decision: Decision, num_experts: int, group: GroupHandle) -> DispatchPlan:
    """The `DispatchPlan` of `decision` for experts split over `group`. The b·s·k assignments are sorted
    by a key, their expert or E (after the last) when dropped, with a stable argsort; the counts come
    from a scatter-add (no `nonzero`, no `bincount`, no mask indexing: nothing waits for the device).
    With P > 1: one all-to-all of E/P integers per peer over `group` (`exchange_counts`) and one host
    synchronisation, a `.tolist()` of the split sizes and the local experts' counts together."""
    E = num_experts
    k = decision.indices.shape[1]
    key = torch.where(decision.keep, decision.indices, E).flatten()  # (b·s·k,) expert of each assignment; E: dropped
    order = torch.argsort(key, stable=True)  # (b·s·k,) by expert, token-major within one, the dropped last
    token, slot = torch.div(order, k, rounding_mode="floor"), order % k
    counts = torch.zeros(E + 1, dtype=torch.long, device=key.device).scatter_add_(0, key, torch.ones_like(key))[:E]
    P = group.size
    if P == 1:
        return DispatchPlan(decision, token, slot, counts)
    received = exchange_counts(counts, group)  # (P, E/P)
    sizes = torch.cat([counts.view(P, -1).sum(1), received.sum(1), received.sum(0)]).tolist()  # the one host sync
    sends, recvs, local = sizes[:P], sizes[P:2 * P], sizes[2 * P:]
    n = sum(sends)
    return DispatchPlan(decision, token[:n].clone(), slot[:n].clone(), counts, received, sends, recvs, local)


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


__all__ = ["AllToAll", "DispatchPlan", "exchange_counts", "plan_dispatch"]
