"""A `Timeline` as a Chrome trace (Perfetto, chrome://tracing): ph "X" events, one tid per stage.

Every compute block is one complete ("X") event named by its short form (``F3``, ``B3c1``,
``W3``) in category ``compute``; every transfer that takes time is one in category ``p2p``
(with free p2p there are none). Time is `us_per_unit` microseconds per simulator time unit
(default 1000: a unit-cost forward is 1 ms). Thread-name metadata events name the rows.
"""
from __future__ import annotations

from megazero.viz.timeline import Block, Timeline


def _event(b: Block, category: str, us_per_unit: float) -> dict:
    args = {"stage": b.stage, "kind": b.kind, "mb": b.mb, "chunk": b.chunk, "start": b.start, "end": b.end}
    if b.peer is not None:
        args["peer"] = b.peer
    return {"name": b.short, "cat": category, "ph": "X", "pid": 0, "tid": b.stage,
            "ts": b.start * us_per_unit, "dur": b.duration * us_per_unit, "args": args}


def chrome_trace(timeline: Timeline, us_per_unit: float = 1000.0) -> dict:
    """The trace as a dict (``json.dump`` it); ``traceEvents`` plus the per-stage bubble in ``metadata``."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": timeline.title}}]
    events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": f"stage {s}"}}
               for s in range(timeline.num_stages)]
    events += [_event(b, "compute", us_per_unit) for b in timeline.blocks]
    events += [_event(b, "p2p", us_per_unit) for b in timeline.transfers if b.duration > 0]
    metadata = {"title": timeline.title, "makespan": timeline.makespan, "bubble": timeline.bubble,
                "stage_bubble": [s.bubble for s in timeline.stages],
                "peak_inflight": [s.peak_inflight for s in timeline.stages]}
    return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": metadata}


__all__ = ["chrome_trace"]
