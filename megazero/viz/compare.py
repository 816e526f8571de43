"""Two timelines of one step on one time axis: planned (or predicted) above measured (pure).

`compare(plan, run)` pairs the blocks of the two by (stage, kind, micro-batch, chunk) and reports, per
stage, each one's bubble and their difference; the stage whose bubble differs most; and the block whose
end differs most between the two (where the run fell behind, or ran ahead of, its plan). The renderers
draw a `Comparison` with two rows per stage. Ties in the block difference go to the earliest planned
block: when a delay carries over to every later block of a stage, the block named is where it began.
Loads are left out of that search (a load's delay is its micro-batch's forward's).
"""
from __future__ import annotations

from dataclasses import dataclass

from megazero.viz.timeline import SHORT, Block, Timeline, embeddable_json


@dataclass(frozen=True)
class StageDiff:
    """One stage: the plan's and the run's bubble (fractions of their own makespans) and run - plan."""

    stage: int
    plan_bubble: float
    run_bubble: float

    @property
    def difference(self) -> float:
        return self.run_bubble - self.plan_bubble


@dataclass(frozen=True)
class Comparison:
    """`plan` (planned or predicted) and `run` (measured) of the same schedule and stages."""

    plan: Timeline
    run: Timeline
    stages: tuple[StageDiff, ...]
    worst_stage: int
    worst_block: tuple[Block, Block] | None  # (plan's, run's) block whose end differs most

    @property
    def num_stages(self) -> int:
        return self.plan.num_stages

    @property
    def title(self) -> str:
        return f"{self.plan.source} vs {self.run.source}, {self.run.title}"

    def summary(self) -> str:
        """Lines: both makespans and bubbles, each stage's bubbles, and where they differ most."""
        unit = self.run.unit and " " + self.run.unit
        lines = [f"{self.plan.source}: {self.plan.title}  makespan {self.plan.makespan:.4g}{unit}  "
                 f"bubble {self.plan.bubble:.1%}",
                 f"{self.run.source}: {self.run.title}  makespan {self.run.makespan:.4g}{unit}  "
                 f"bubble {self.run.bubble:.1%}"]
        lines += [f"stage {d.stage}: bubble {self.plan.source} {d.plan_bubble:.1%}, {self.run.source} "
                  f"{d.run_bubble:.1%} ({d.difference:+.1%})" for d in self.stages]
        lines.append(self.differs_most())
        return "\n".join(lines)

    def differs_most(self) -> str:
        d = self.stages[self.worst_stage]
        if self.worst_block is None and abs(d.difference) <= AGREE:
            return f"{self.plan.source} and {self.run.source} agree (within {AGREE:g} of the step)"
        line = f"differs most: stage {d.stage}'s bubble ({d.difference:+.1%})"
        if self.worst_block is not None:
            a, b = self.worst_block
            unit = self.run.unit and " " + self.run.unit
            line += (f"; {b.short} on stage {b.stage} ends at {b.end:.4g}{unit} measured against {a.end:.4g}{unit} "
                     f"{self.plan.source} ({b.end - a.end:+.4g}{unit})")
        return line

    def to_dict(self) -> dict:
        worst = None
        if self.worst_block is not None:
            a, b = self.worst_block
            worst = {"stage": b.stage, "kind": b.kind, "mb": b.mb, "chunk": b.chunk, "plan_end": a.end, "run_end": b.end}
        return {"plan": self.plan.to_dict(), "run": self.run.to_dict(),
                "stages": [{"stage": d.stage, "plan_bubble": d.plan_bubble, "run_bubble": d.run_bubble,
                            "difference": d.difference} for d in self.stages],
                "worst_stage": self.worst_stage, "worst_block": worst}

    def to_json(self) -> str:
        """`to_dict` as JSON safe inside HTML <script> and XML (`timeline.embeddable_json`)."""
        return embeddable_json(self.to_dict())


AGREE = 1e-6
"""Differences below this fraction of the step are agreement, not a difference."""


def _key(b: Block) -> tuple:
    return (b.stage, SHORT.get(b.kind, b.kind), b.mb, b.chunk)


def compare(plan: Timeline, run: Timeline) -> Comparison:
    """The `Comparison` of two timelines of the same pipeline (ValueError if their stages differ)."""
    if plan.num_stages != run.num_stages:
        raise ValueError(f"cannot compare {plan.num_stages} planned stages with {run.num_stages} measured ones")
    stages = tuple(StageDiff(s, a.bubble, b.bubble) for s, (a, b) in enumerate(zip(plan.stages, run.stages)))
    worst_stage = max(range(len(stages)), key=lambda s: abs(stages[s].difference))
    planned = {_key(b): b for b in plan.blocks}
    pairs = [(planned[_key(b)], b) for b in run.blocks if _key(b) in planned and b.kind != "LoadMicroBatch"]
    scale = max(plan.makespan, run.makespan, 1e-12)
    # the largest difference of ends; among equal ones (to 1e-9 of the step) the earliest planned: where it began
    worst = max(pairs, key=lambda ab: (round(abs(ab[1].end - ab[0].end) / scale, 9), -ab[0].end), default=None)
    if worst is not None and abs(worst[1].end - worst[0].end) <= AGREE * scale:
        worst = None
    return Comparison(plan, run, stages, worst_stage, worst)


__all__ = ["Comparison", "StageDiff", "compare"]
