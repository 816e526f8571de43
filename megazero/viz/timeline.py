"""The data behind a schedule picture: a `Timeline` built from the simulator's result (pure).

`from_simulation(result, title)` turns `simulate`'s per-stage spans into blocks:

* compute blocks, one per Forward / Backward / BackwardInput / BackwardWeight span, with stage,
  kind (the instruction's class name), micro-batch, local chunk, start and end; loads, gradient
  reductions and optimizer steps are blocks too when they take time (the planner's predictions and
  measured runs; ``mb`` is -1 for the two step-level ones);
* transfers, one per send or receive span (the same fields plus the peer stage); with free p2p
  (the default costs) they last zero time and pictures leave them out;
* per stage: busy and idle time, bubble = idle / makespan, peak in-flight and peak unfinished
  micro-batch chunks (`simulate.peaks`), and the bytes of the activations at that peak when the model
  is known (`peak_bytes`); in total the simulator's bubble fraction.

`unit` names the time axis ("" for the simulator's units, "ms" for predictions and measurements) and
`source` says where the times come from ("planned", "predicted" or "measured"). `megazero.viz.measured`
builds the same `Timeline` from a run's traces, so every renderer draws all three alike.

Nothing here is computed anew: every number is the simulator's, so a picture that draws a
`Timeline` shows exactly what `simulate` measured. `Timeline.to_json()` is what the SVG and HTML embed.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Sequence

from megazero.core.instructions import COMPUTE, P2P, Instruction, LoadMicroBatch, OptimizerStep, ReduceGrads
from megazero.core.simulate import SimResult

KINDS = ("Forward", "Backward", "BackwardInput", "BackwardWeight", "LoadMicroBatch", "ReduceGrads", "OptimizerStep")
"""Block kinds, in legend order (`Backward` is a full backward, input and weight grads). The last three
are drawn only when they take time."""
STEP_KINDS = (LoadMicroBatch, ReduceGrads, OptimizerStep)
SHORT = {"Forward": "F", "Backward": "B", "BackwardInput": "B", "BackwardWeight": "W", "LoadMicroBatch": "L",
         "ReduceGrads": "R", "OptimizerStep": "O"}
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
        """Micro-batch and, with interleaving, chunk: ``3`` or ``3c1``; ``R`` and ``O`` for the
        step's gradient reduction and optimizer step."""
        if self.mb < 0:
            return SHORT.get(self.kind, self.kind)
        return f"{self.mb}c{self.chunk}" if self.chunk else f"{self.mb}"

    @property
    def short(self) -> str:
        """The instruction's short form: ``F3``, ``B3c1``, ``W3`` (B for Backward and BackwardInput),
        ``L3``, ``R``, ``O``."""
        letter = SHORT.get(self.kind)
        if self.mb < 0 and letter is not None:
            return letter
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
    peak_bytes: int | None = None


@dataclass(frozen=True)
class Timeline:
    """Everything a picture of one step shows. `title` names the schedule and its sizes; `unit` the
    time axis ("" = simulator units); `source` is "planned", "predicted" or "measured"."""

    title: str
    num_stages: int
    makespan: float
    bubble: float
    blocks: tuple[Block, ...]
    transfers: tuple[Block, ...]
    stages: tuple[StageSummary, ...]
    unit: str = ""
    source: str = "planned"

    def blocks_of(self, stage: int) -> tuple[Block, ...]:
        return tuple(b for b in self.blocks if b.stage == stage)

    def to_dict(self) -> dict:
        """Plain data (lists, numbers, strings), as embedded in the pictures."""
        return asdict(self)

    def to_json(self) -> str:
        """`to_dict` as JSON safe to embed in HTML and XML (`embeddable_json`)."""
        return embeddable_json(self.to_dict())

    @property
    def heading(self) -> str:
        """The title, after the source unless the timeline is a plan in simulator units."""
        return self.title if self.source == "planned" and not self.unit else f"{self.source}: {self.title}"

    def summary(self) -> str:
        """One line: makespan, total bubble, per-stage bubble and peak in-flight micro-batches."""
        per_stage = " ".join(f"{s.bubble:.1%}" for s in self.stages)
        peaks = [s.peak_inflight for s in self.stages]
        line = (f"{self.heading}  makespan {self.makespan:g}{self.unit and ' ' + self.unit}  bubble {self.bubble:.1%} "
                f"of the step (per stage {per_stage})  peak in-flight micro-batches per stage {peaks}")
        if all(s.peak_bytes is not None for s in self.stages):
            line += " (" + " ".join(format_bytes(s.peak_bytes) for s in self.stages) + ")"
        return line


def embeddable_json(data) -> str:
    """`data` as compact JSON safe inside an HTML ``<script>`` and in XML: ``<``, ``>`` and ``&`` are
    written as \\u escapes, which JSON readers decode back."""
    text = json.dumps(data, separators=(",", ":"))
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def format_bytes(n: int) -> str:
    """``12.5 MiB``, ``3.20 GiB``, ``512 B``."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def block_of(stage: int, start: float, end: float, ins: Instruction) -> Block:
    """The block of instruction `ins` run on `stage` over [start, end)."""
    peer = ins.peer if isinstance(ins, P2P) else None
    return Block(stage, type(ins).__name__, getattr(ins, "mb", -1), getattr(ins, "chunk", 0), start, end, peer)


def from_simulation(result: SimResult, title: str = "schedule", *, unit: str = "", source: str = "planned",
                    scale: float = 1.0, peak_bytes: Sequence[int] | None = None) -> Timeline:
    """The `Timeline` of a `simulate` result (its spans, idle time, bubble and peaks unchanged).
    `scale` multiplies every time (the planner's seconds drawn as ms: 1e3); `peak_bytes` are the
    activation bytes of each stage at its peak, when the model is known."""
    blocks, transfers = [], []
    for stage, spans in enumerate(result.timeline):
        for span in spans:
            block = block_of(stage, span.start * scale, span.end * scale, span.instr)
            if isinstance(span.instr, COMPUTE) or (isinstance(span.instr, STEP_KINDS) and span.end > span.start):
                blocks.append(block)
            elif isinstance(span.instr, P2P):
                transfers.append(block)
    stages = tuple(
        StageSummary(s, result.busy[s] * scale, result.idle[s] * scale,
                     result.idle[s] / result.makespan if result.makespan else 0.0,
                     result.peak_inflight[s], result.peak_unfinished[s],
                     None if peak_bytes is None else int(peak_bytes[s]))
        for s in range(result.num_stages))
    return Timeline(title, result.num_stages, result.makespan * scale, result.bubble_fraction, tuple(blocks),
                    tuple(transfers), stages, unit, source)


def kinds_present(blocks: Sequence[Block]) -> tuple[str, ...]:
    """The compute kinds that occur in `blocks`, in legend order."""
    seen = {b.kind for b in blocks}
    return tuple(k for k in KINDS if k in seen)


__all__ = ["Block", "KINDS", "SHORT", "StageSummary", "TRANSFER_KINDS", "Timeline", "block_of", "embeddable_json",
           "format_bytes", "from_simulation", "kinds_present"]
