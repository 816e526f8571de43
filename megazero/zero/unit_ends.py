"""Where every dp rank launches its gradient reductions when the model's graph depends on the data.

A user's nn.Module may skip parts of itself per batch (a Mixtral expert that gets no token on this
rank, a conditional branch): which gradients a rank's backward produces, and when a bucket completes,
then differ between the dp ranks. Each reduction must still be issued at the same place on every rank:
NCCL matches collectives by their position on a communicator, and at stage 3 the reductions share the
dp group with backward's parameter gathers. `UnitEnds` gives such places: the end of each unit's
backward (the gradient of its inputs is computed), which every rank reaches in the same order whatever
its data. The units are the ZeRO gathering units of the module (`megazero.engine.factories.zero_units`:
a transformer's blocks); a unit whose inputs need no gradient (the embedding) has no end here, and its
buckets go at the end of backward (`megazero.zero.flat_group.FlatGroup.flush`).
"""
from __future__ import annotations

import torch

from megazero.zero.stage3 import call_in_backward


class UnitEnds:
    """Calls `on_end(u, through)` once per backward when unit u's backward has ended, `through` the
    [(flat group, bucket b)] whose buckets up to b hold only parameters of units >= u (their backward
    is over), to be launched complete or not. Communicates nothing itself."""

    def __init__(self, units, groups, on_end):
        self.on_end = on_end
        owner: dict[int, int] = {}  # parameter -> the first unit holding it
        for u, mod in enumerate(units):
            for p in mod.parameters():
                owner.setdefault(id(p), u)
        self.through: list[list[tuple[object, int]]] = [[] for _ in units]
        for group in groups:
            lowest: dict[int, int] = {}  # owning unit (-1: none) -> the lowest bucket holding one of its parameters
            for i, p in enumerate(group.params):
                o, b = owner.get(id(p), -1), group.layout.bucket_of(i)
                lowest[o] = min(lowest.get(o, b), b)
            for u in range(len(units)):  # blocked: the first bucket with a parameter whose backward may not be over
                blocked = min((b for o, b in lowest.items() if o < u), default=len(group.layout.buckets))
                if blocked > 0:
                    self.through[u].append((group, blocked - 1))
        self.ended: set[int] = set()  # units whose backward ended in this backward
        self.handles = [mod.register_forward_pre_hook(self._pre_forward(u), with_kwargs=True)
                        for u, mod in enumerate(units)]

    def _pre_forward(self, u):
        def hook(mod, args, kwargs):
            if not torch.is_grad_enabled():
                return None
            end = lambda: self._ended(u)  # noqa: E731
            return call_in_backward(args, end), call_in_backward(kwargs, end)
        return hook

    def _ended(self, u: int) -> None:
        if u not in self.ended:
            self.ended.add(u)
            self.on_end(u, self.through[u])

    def reset(self) -> None:
        """End of a backward: the next one starts afresh."""
        self.ended.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


__all__ = ["UnitEnds"]
