"""The data behind a schedule picture: a `Timeline` built from the simulator's result (pure).

`from_simulation(result, title)` turns `simulate`'s per-stage spans into blocks:

* compute blocks, one per Forward / Backward / BackwardInput / BackwardWeight span, with stage,
  kind (the instruction's class name), micro-batch, local chunk, start and end;
* transfers, one per send or receive span (the same fields plus the peer stage); with free p2p
  (the default costs) they last zero time and pictures leave them out;
* per stage: busy and idle time, bubble = idle / makespan, peak in-flight and peak unfinished
  micro-batch chunks (`simulate.peaks`); in total the simulator's bubble fraction.

Nothing here is computed anew: every number is the simulator's, so a picture that draws a
`Timeline` shows exactly what `simulate` measured. `Timeline.to_json()` is what the SVG and HTML embed.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Sequence

from megazero.core.instructions import COMPUTE, P2P, Instruction
from megazero.core.simulate import SimResult

KINDS = ("Forward", "Backward", "BackwardInput", "BackwardWeight")
"""Compute block kinds, in legend order (`Backward` is a full backward, input and weight grads)."""
TRANSFER_KINDS = ("SendAct", "RecvAct", "SendGrad", "RecvGrad")


@dataclass(frozen=True)
class Block:
    """One instruction's span on one stage: [start, end) in the simulator's time units.
    `peer` is the other stage of a transfer (None for compute)."""

    stage: int
    kind: str
    mb: int
    chunk: int
    start: float
    end: float
    peer: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def label(self) -> str:
        """Micro-batch and, with interleaving, chunk: ``3`` or ``3c1``."""
        return f"{self.mb}c{self.chunk}" if self.chunk else f"{self.mb}"

    @property
    def short(self) -> str:
        """The instruction's short form: ``F3``, ``B3c1``, ``W3`` (B for Backward and BackwardInput)."""
        letter = {"Forward": "F", "Backward": "B", "BackwardInput": "B", "BackwardWeight": "W"}.get(self.kind)
        if letter is None:
            return f"{self.kind} {self.label}" + (f" peer {self.peer}" if self.peer is not None else "")
        return f"{letter}{self.label}"


@dataclass(frozen=True)
class StageSummary:
    """One stage's totals, as the simulator measured them."""

    stage: int
    busy: float
    idle: float
    bubble: float
    peak_inflight: int
    peak_unfinished: int


@dataclass(frozen=True)
class Timeline:
    """Everything a picture of one simulated step shows. `title` names the schedule and its sizes."""

    title: str
    num_stages: int
    makespan: float
    bubble: float
    blocks: tuple[Block, ...]
    transfers: tuple[Block, ...]
    stages: tuple[StageSummary, ...]

    def blocks_of(self, stage: int) -> tuple[Block, ...]:
        return tuple(b for b in self.blocks if b.stage == stage)

    def to_dict(self) -> dict:
        """Plain data (lists, numbers, strings), as embedded in the pictures."""
        return asdict(self)

    def to_json(self) -> str:
        """`to_dict` as JSON safe to embed in HTML ``<script>`` and in XML: ``<``, ``>`` and ``&``
        are written as \\u escapes, which JSON readers decode back."""
        text = json.dumps(self.to_dict(), separators=(",", ":"))
        return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")

    def summary(self) -> str:
        """One line: makespan, total bubble, per-stage bubble and peak in-flight micro-batches."""
        per_stage = " ".join(f"{s.bubble:.1%}" for s in self.stages)
        peaks = [s.peak_inflight for s in self.stages]
        return (f"{self.title}  makespan {self.makespan:g}  bubble {self.bubble:.1%} of the step "
                f"(per stage {per_stage})  peak in-flight micro-batches per stage {peaks}")


def _block(stage: int, start: float, end: float, ins: Instruction) -> Block:
    peer = ins.peer if isinstance(ins, P2P) else None
    return Block(stage, type(ins).__name__, ins.mb, ins.chunk, start, end, peer)


def from_simulation(result: SimResult, title: str = "schedule") -> Timeline:
    """The `Timeline` of a `simulate` result (its spans, idle time, bubble and peaks unchanged)."""
    blocks, transfers = [], []
    for stage, spans in enumerate(result.timeline):
        for span in spans:
            if isinstance(span.instr, COMPUTE):
                blocks.append(_block(stage, span.start, span.end, span.instr))
            elif isinstance(span.instr, P2P):
                transfers.append(_block(stage, span.start, span.end, span.instr))
    stages = tuple(
        StageSummary(s, result.busy[s], result.idle[s], result.idle[s] / result.makespan if result.makespan else 0.0,
                     result.peak_inflight[s], result.peak_unfinished[s])
        for s in range(result.num_stages))
    return Timeline(title, result.num_stages, result.makespan, result.bubble_fraction, tuple(blocks),
                    tuple(transfers), stages)


def kinds_present(blocks: Sequence[Block]) -> tuple[str, ...]:
    """The compute kinds that occur in `blocks`, in legend order."""
    seen = {b.kind for b in blocks}
    return tuple(k for k in KINDS if k in seen)


__all__ = ["Block", "KINDS", "StageSummary", "TRANSFER_KINDS", "Timeline", "from_simulation", "kinds_present"]
