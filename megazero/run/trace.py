"""Per-rank Chrome-trace events of every pipeline instruction (`trace.enabled`).

Each rank writes `<run_dir>/trace/rank<r>.json` in the Chrome trace-event format (Perfetto and
chrome://tracing open it): one complete event ("ph": "X") per executed instruction, pid = pipeline
stage, tid = global rank, name = the instruction's short repr ("F3", "SA3>1", ...), with the step
number, micro-batch, chunk and peer stage in args. The metadata holds the rank's grid coordinates,
the Unix time of the trace's origin (so that ranks, and hosts with synchronised clocks, share one
time axis) and, once known, the activation bytes this rank kept at its peak in the first step.
`python -m megazero.viz --run RUN_DIR` reads these files to draw the measured timeline.
"""
from __future__ import annotations

import json
import os
import time

from megazero.core import instructions as I


class Tracer:
    """Collects this rank's instruction events for one run; `save()` writes them as a Chrome trace."""

    def __init__(self, path: str, rank: int, stage: int, dp_rank: int, tp_rank: int, world_size: int):
        self.path, self.rank, self.stage = path, rank, stage
        self.t0, unix = time.perf_counter(), time.time()  # one origin on both clocks
        self.meta = {"rank": rank, "stage": stage, "dp_rank": dp_rank, "tp_rank": tp_rank, "world_size": world_size,
                     "unix_origin_s": unix}
        self.events: list[dict] = []
        self.step = 0

    def event(self, ins, start: float, end: float) -> None:
        args = {"step": self.step, "mb": ins.mb if isinstance(ins, I.PER_MICROBATCH) else None,
                "chunk": getattr(ins, "chunk", 0)}
        if isinstance(ins, I.P2P):
            args["peer"] = ins.peer
        self.events.append({"name": repr(ins), "cat": type(ins).__name__, "ph": "X", "pid": self.stage,
                            "tid": self.rank, "ts": (start - self.t0) * 1e6, "dur": (end - start) * 1e6,
                            "args": args})

    def note_peak_activations(self, nbytes: int) -> None:
        """Record the activation bytes this rank kept at its peak (the trainer's first-step meter)."""
        self.meta["peak_activation_bytes"] = int(nbytes)

    def begin_step(self, step: int) -> None:
        """The events that follow belong to training step `step` (1-based, as in the metrics)."""
        self.step = step

    def save(self) -> str:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        meta = [{"name": "process_name", "ph": "M", "pid": self.stage, "args": {"name": f"stage {self.stage}"}},
                {"name": "thread_name", "ph": "M", "pid": self.stage, "tid": self.rank,
                 "args": {"name": f"rank {self.rank} (dp {self.meta['dp_rank']}, tp {self.meta['tp_rank']})"}}]
        with open(self.path, "w") as f:
            json.dump({"traceEvents": meta + self.events, "displayTimeUnit": "ms", "metadata": self.meta}, f)
        return self.path
