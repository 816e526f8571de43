"""Silent errors: a step's gradients computed twice on the same data, and the rank that computed a wrong number named.

Hardware now and then computes a wrong number without failing (a flipped bit in a GEMM, a bad core). On a
checked step (every `interval` steps, or a step whose loss exceeds `spike` times the median of the last 20)
the pipeline engine runs the step's forwards and backwards twice (`PipelineEngine._checked_step`): the same
micro-batches, the same random states, no reduction launched (ZeRO stages 0-1 keep each rank's own
gradients), then the step's reduction and update once. While the passes run, every rank's communication
records a fingerprint of each tensor it sends and receives (`comm.note`, in order), and after each pass of
its own gradients. A rank whose two passes differ either received different data first (a peer's error
reached it) or sent or computed different data first: the latter is where the error happened, and is named
(`origins`). Deterministic paths (a CPU, or `torch.use_deterministic_algorithms`) compare bitwise; with
`rtol` > 0 the gradients are compared within that bound (relative to the largest) and every rank beyond it
is named, as fingerprints cannot tell rounding from an error there. Every rank learns the verdict through
one all-gather over the world group, and all stop, skip the step or warn together (`action`).
Off (interval 0, spike 0), nothing of this runs. With the spike check on, every step runs its first pass this
way (no overlap of the gradient reductions, the fingerprints, one more all-reduce of two numbers), and the
second when its loss spiked. A process's first step is never checked (a boundary's shapes travel in it).
"""
from __future__ import annotations

import statistics

import torch

from megazero.runtime import comm


class SilentError(RuntimeError):
    """A checked step's two passes differed (every rank raises it, with the same text)."""


def first_difference(a: list, b: list) -> tuple[int, str] | None:
    """(index, direction) of the first entry where two passes' fingerprint lists differ (a length difference
    counts as one, "out": this rank did something else), None when equal. Local."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i, x[0]
    if len(a) != len(b):
        return min(len(a), len(b)), "out"
    return None


def origins(verdicts: list[dict]) -> list[int]:
    """The ranks where the error happened, from every rank's verdict ({"differs", "first"}): those whose first
    difference is something they sent or computed ("out", "grad"), not something they received; where no rank
    qualifies (the error reached them through a path not fingerprinted), every rank that differs."""
    differ = [r for r, v in enumerate(verdicts) if v["differs"]]
    first = [r for r in differ if verdicts[r]["first"] in ("out", "grad")]
    return first or differ


class SilentCheck:
    """One rank's side of the check (see the module docstring): `due(step)` before a step, `record_loss` after
    each step; `verdict(...)` compares this rank's two passes and agrees with every rank over `world`."""

    def __init__(self, world: comm.GroupHandle, interval: int = 0, spike: float = 0.0, action: str = "stop",
                 rtol: float = 0.0, history: int = 20):
        self.world, self.interval, self.spike, self.action, self.rtol = world, interval, spike, action, rtol
        self.history = history
        self.losses: list[float] = []

    def due(self, step: int) -> bool:
        """Whether step `step` (1-based) is checked on the interval (the same answer on every rank)."""
        return bool(self.interval) and step % self.interval == 0

    def spiked(self, loss: float) -> bool:
        """Whether `loss` (agreed on every rank) exceeds `spike` times the median of the last losses."""
        return bool(self.spike) and len(self.losses) >= 3 and loss > self.spike * statistics.median(self.losses)

    def record_loss(self, loss: float) -> None:
        """Keep `loss` (agreed on every rank) among the last `history` for `spiked`."""
        self.losses = (self.losses + [loss])[-self.history:]

    def fingerprints(self, stats: comm.CommStats, grads: list[torch.Tensor]) -> list:
        """The pass's communication fingerprints, then one per gradient buffer, as host tuples (one transfer)."""
        events = list(stats.fingerprints or []) + [("grad", "local", comm.checksum(g)) for g in grads]
        values = torch.stack([c for _, _, c in events]).tolist() if events else []
        return [(d, axis, v) for (d, axis, _), v in zip(events, values)]

    def verdict(self, step: int, first: list, second: list, grads_a: list[torch.Tensor] | None,
                grads_b: list[torch.Tensor]) -> dict:
        """Compare this rank's two passes (fingerprints; with `rtol`, the first pass's gradients `grads_a` against
        the second's) and gather every rank's result over the world group; returns {"step", "ranks": [named],
        "differ": [ranks whose passes differ], "max_diff" (with `rtol`; else None)} on every rank."""
        if self.rtol:
            worst = max((float((a - b).abs().max()) for a, b in zip(grads_a, grads_b) if a.numel()), default=0.0)
            scale = max((float(a.abs().max()) for a in grads_a if a.numel()), default=0.0)
            mine = {"differs": worst > self.rtol * scale, "first": "grad", "max_diff": worst}
        else:
            found = first_difference(first, second)
            mine = {"differs": found is not None, "first": found[1] if found else None, "max_diff": None}
        verdicts = comm.all_gather_object(mine, self.world)  # world group: every rank's verdict
        differ = [r for r, v in enumerate(verdicts) if v["differs"]]
        diffs = [v["max_diff"] for v in verdicts if v["max_diff"] is not None]
        return {"step": step, "ranks": origins(verdicts) if differ else [], "differ": differ,
                "max_diff": max(diffs) if diffs else None}

    def message(self, found: dict) -> str:
        largest = f", largest difference {found['max_diff']:.3g}" if found["max_diff"] is not None else ""
        return (f"silent error at step {found['step']}: rank(s) {found['ranks']} computed different results from the "
                f"same data and parameters (two passes of the step; ranks whose results differ: "
                f"{found['differ']}{largest}); resilience.silent_error_action={self.action}")
