"""Per-rank Chrome-trace events of every pipeline instruction (`trace.enabled`).

Each rank writes `<run_dir>/trace/rank<r>.json` in the Chrome trace-event format (Perfetto and
chrome://tracing open it): one complete event ("ph": "X") per executed instruction, pid = pipeline
stage, tid = global rank, name = the instruction's short repr ("F3", "SA3>1", ...), with the step
number in args. The schedule visualizer reads the same files to draw measured timelines.
"""
from __future__ import annotations

import json
import os
import time

from megazero.core import instructions as I


class Tracer:
    """Collects this rank's instruction events for one run; `save()` writes them as a Chrome trace."""

    def __init__(self, path: str, rank: int, stage: int, dp_rank: int, tp_rank: int):
        self.path, self.rank, self.stage = path, rank, stage
        self.meta = {"rank": rank, "stage": stage, "dp_rank": dp_rank, "tp_rank": tp_rank}
        self.events: list[dict] = []
        self.step = 0
        self.t0 = time.perf_counter()

    def event(self, ins, start: float, end: float) -> None:
        self.events.append({"name": repr(ins), "cat": type(ins).__name__, "ph": "X", "pid": self.stage,
                            "tid": self.rank, "ts": (start - self.t0) * 1e6, "dur": (end - start) * 1e6,
                            "args": {"step": self.step, "mb": ins.mb if isinstance(ins, I.PER_MICROBATCH) else None}})

    def next_step(self) -> None:
        self.step += 1

    def save(self) -> str:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        meta = [{"name": "process_name", "ph": "M", "pid": self.stage, "args": {"name": f"stage {self.stage}"}},
                {"name": "thread_name", "ph": "M", "pid": self.stage, "tid": self.rank,
                 "args": {"name": f"rank {self.rank} (dp {self.meta['dp_rank']}, tp {self.meta['tp_rank']})"}}]
        with open(self.path, "w") as f:
            json.dump({"traceEvents": meta + self.events, "displayTimeUnit": "ms", "metadata": self.meta}, f)
        return self.path
