"""The character grid of a `Timeline` (``--format text``): one row per stage, one column per time step.

A cell shows what runs then: forward of micro-batch n as 0-9 then a-z, backward (full, or input
grad) of micro-batch n as A-Z (A = micro-batch 0), the zero-bubble weight-grad pass as w, and idle
time (the bubble) as '.'. With unit costs a column is one time unit (today's grid); with other
costs a column is the shortest compute block's duration.
"""
from __future__ import annotations

from megazero.viz.timeline import Timeline

FWD = "0123456789abcdefghijklmnopqrstuvwxyz"
BWD = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
LEGEND = ("legend: 0-9a-z forward of micro-batch n, A-Z backward (input grad, or full) of micro-batch n, "
          "w weight-grad pass (zero bubble), . idle")
STEP_CELLS = {"LoadMicroBatch": ",", "ReduceGrads": "=", "OptimizerStep": "+"}
STEP_LEGEND = {"LoadMicroBatch": "',' load", "ReduceGrads": "'=' gradient reduction", "OptimizerStep": "'+' optimizer step"}


def cell(kind: str, mb: int) -> str:
    """The character of a block: `kind` is F, B (full or input grad) or W."""
    if kind == "F":
        return FWD[mb % len(FWD)]
    if kind == "B":
        return BWD[mb % len(BWD)]
    return "w"


def column_time(timeline: Timeline, max_columns: int | None = None) -> float:
    """The time one column stands for: the shortest compute block (1 with unit costs), or longer
    when the grid would pass `max_columns`."""
    shortest = min((b.duration for b in timeline.blocks if b.duration > 0), default=1.0)
    return max(shortest, timeline.makespan / max_columns) if max_columns else shortest


def grid(timeline: Timeline, max_columns: int | None = None, unit: float | None = None) -> list[str]:
    """One string per stage; `column_time` time per character (or `unit`). A block shorter than a column
    takes one; loads, gradient reductions and optimizer steps that take time are ``,``, ``=``, ``+``."""
    unit = unit or column_time(timeline, max_columns)
    width = int(round(timeline.makespan / unit))
    rows = [["."] * width for _ in range(timeline.num_stages)]
    for b in timeline.blocks:
        char = STEP_CELLS.get(b.kind) or cell(b.short[0], b.mb)
        first = int(round(b.start / unit))
        for t in range(first, min(max(int(round(b.end / unit)), first + 1), width)):
            rows[b.stage][t] = char
    return ["".join(r) for r in rows]


def header(timeline: Timeline) -> str:
    """Today's first line: makespan, bubble of the step, peak in-flight micro-batches per stage."""
    unit = timeline.unit and " " + timeline.unit
    return (f"{timeline.heading}  makespan {timeline.makespan:.6g}{unit}  bubble {timeline.bubble:.1%} of the step  "
            f"peak in-flight micro-batches per stage {[s.peak_inflight for s in timeline.stages]}")


def legend(timeline: Timeline) -> str:
    """`LEGEND`, with the characters of the step-level blocks the timeline has."""
    extra = [STEP_LEGEND[k] for k in STEP_LEGEND if any(b.kind == k for b in timeline.blocks)]
    return ", ".join([LEGEND] + extra)


def render_text(timeline: Timeline, max_columns: int | None = None, unit: float | None = None) -> str:
    """Header, one ``stage s`` row each, the legend (what `python -m megazero.viz` prints). `unit`: the
    time of one column (default `column_time`); two timelines drawn with one unit share a time axis."""
    rows = grid(timeline, max_columns, unit)
    col = unit or column_time(timeline, max_columns)
    lines = [header(timeline)] + [f"stage {s} {row}" for s, row in enumerate(rows)]
    if timeline.unit:
        lines.append(f"one column = {col:.4g} {timeline.unit}")
    return "\n".join(lines + [legend(timeline)])


__all__ = ["LEGEND", "cell", "column_time", "grid", "header", "legend", "render_text"]
