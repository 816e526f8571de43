"""A `Timeline` as a Chrome trace (Perfetto, chrome://tracing): ph "X" events, one tid per stage.

Every compute block is one complete ("X") event named by its short form (``F3``, ``B3c1``,
``W3``) in category ``compute``; every transfer that takes time is one in category ``p2p``
(with free p2p there are none). Time is `us_per_unit` microseconds per time unit (default 1000: a
unit-cost forward is 1 ms, and predicted or measured timelines, in ms, keep their times). Thread-name
metadata events name the rows; a `Comparison` is two processes, the plan's and the run's.
"""
from __future__ import annotations

from megazero.viz.compare import Comparison
from megazero.viz.timeline import Block, Timeline


def _event(b: Block, category: str, us_per_unit: float, pid: int = 0) -> dict:
    args = {"stage": b.stage, "kind": b.kind, "mb": b.mb, "chunk": b.chunk, "start": b.start, "end": b.end}
    if b.peer is not None:
        args["peer"] = b.peer
    return {"name": b.short, "cat": category, "ph": "X", "pid": pid, "tid": b.stage,
            "ts": b.start * us_per_unit, "dur": b.duration * us_per_unit, "args": args}


def _process(timeline: Timeline, pid: int, us_per_unit: float) -> list[dict]:
    events = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": timeline.title}}]
    events += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": s, "args": {"name": f"stage {s}"}}
               for s in range(timeline.num_stages)]
    events += [_event(b, "compute", us_per_unit, pid) for b in timeline.blocks]
    events += [_event(b, "p2p", us_per_unit, pid) for b in timeline.transfers if b.duration > 0]
    return events


def _metadata(timeline: Timeline) -> dict:
    return {"title": timeline.title, "makespan": timeline.makespan, "bubble": timeline.bubble,
            "stage_bubble": [s.bubble for s in timeline.stages],
            "peak_inflight": [s.peak_inflight for s in timeline.stages]}


def chrome_trace(picture, us_per_unit: float | None = None) -> dict:
    """The trace as a dict (``json.dump`` it); ``traceEvents`` plus the per-stage bubble in ``metadata``.
    A `Comparison` is two processes: pid 0 the plan, pid 1 the run (metadata ``plan`` and ``run``).
    `us_per_unit`: default 1000 (a unit-cost forward is 1 ms; timelines in ms keep their times)."""
    if isinstance(picture, Comparison):
        us = 1000.0 if us_per_unit is None else us_per_unit
        events = _process(picture.plan, 0, us) + _process(picture.run, 1, us)
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "metadata": {"plan": _metadata(picture.plan), "run": _metadata(picture.run)}}
    us = 1000.0 if us_per_unit is None else us_per_unit
    return {"traceEvents": _process(picture, 0, us), "displayTimeUnit": "ms", "metadata": _metadata(picture)}


__all__ = ["chrome_trace"]
