"""A stage's memory peaks over its pipeline program (pure: no torch): each micro-batch chunk's `Chunk` ledger
(activation_ledger.py) added at its forward, rebuilt and released at its backward, with the transients that
rise above it at their moments (the loss's logits, the backward's working set or a context-parallel attention
core's, zero bubble's pending W data, ZeRO's gathered and reduced buffers). memory_plan.py turns the levels into its
transient categories."""
from __future__ import annotations

from dataclasses import dataclass

from megazero.core.instructions import Backward, BackwardInput, BackwardWeight, Forward
from megazero.planner.activation_ledger import Chunk


@dataclass(frozen=True)
class Peaks:
    """Peaks over one step: `metered` what SavedActivationMeter reports (kept + rebuilt), `with_logits`
    adding the loss's logits, `working` adding the backward's working set (`Chunk.working`), `real`
    adding zero bubble's pending W data too, `live` adding ZeRO's momentary buffers (see `walk_program`)."""

    metered: int
    with_logits: int
    real: int
    host: int = 0
    live: int = 0
    working: int = 0


def walk_program(program, chunks: list[Chunk], pool: int = 0, pool_host: bool = False, gathered: int = 0,
                 reduced: int = 0, reduced_at_end: int = 0, gathered_head: int = 0) -> Peaks:
    """Walk one stage's program: F adds its chunk's bytes, B (or zero-bubble B) rebuilds and releases
    them, W releases what B left for it. `pool`: the stage's contiguous checkpoint buffer, whole while any
    checkpoint is in it (in host memory when `pool_host`); `host`: the peak of host checkpoints.
    ZeRO's buffers alive at given moments (`live`): `gathered` (ZeRO-3: the parameters gathered when a
    chunk's backward starts, its activations and the first block's backward working set all alive),
    `gathered_head` (ZeRO-3: the head's parameters, gathered again as the loss's gradient reaches the head, the
    logits still alive), `reduced` (the
    reduce-scatter outputs and copies at the end of each micro-batch's backward, stages 2-3, on top of what
    is still alive then) and `reduced_at_end` (stages 0-1: after the last backward)."""
    shared = sum({k: v for ch in chunks for k, v in ch.shared.items()}.values())  # once per stage
    shared += 0 if pool_host else pool
    alive = pending = metered = with_logits = working = real = host = peak_host = live = 0
    for ins in program:
        if isinstance(ins, Forward):
            ch = chunks[ins.chunk]
            host += ch.saved_host
            peak_host = max(peak_host, host + (pool if pool_host else 0))
            alive += ch.saved
            now = alive + shared
            metered, with_logits = max(metered, now), max(with_logits, now + ch.logits)
            working = max(working, with_logits)
            real = max(real, now + ch.logits + pending)
            live = max(live, real, now + ch.logits + pending + (gathered_head if ch.logits else 0))
        elif isinstance(ins, (Backward, BackwardInput)):
            ch = chunks[ins.chunk]
            during = alive - ch.saved + ch.backward_peak + shared
            work = ch.working - (ch.working_wgrad if isinstance(ins, BackwardInput) else 0)
            first = alive - ch.saved + ch.first_backward + shared + work  # at the last block's first GEMM
            first = max(first, alive - ch.saved + ch.first_backward + shared + ch.core)  # its cp core's backward
            metered, with_logits = max(metered, during), max(with_logits, during)
            working = max(working, with_logits, first)
            real = max(real, working, during + pending, first + pending)
            live = max(live, max(during, first) + pending + gathered)  # ZeRO-3: the gathered units beside them
            alive -= ch.saved
            host -= ch.saved_host
            if isinstance(ins, BackwardInput):
                pending += ch.wgrad
                real = max(real, alive + shared + pending)
            live = max(live, real, alive + shared + pending + reduced)
        elif isinstance(ins, BackwardWeight):
            pending -= chunks[ins.chunk].wgrad
    live = max(live, real, shared + reduced_at_end)
    return Peaks(metered, with_logits, real, peak_host, live, working)
