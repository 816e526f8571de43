"""What a user sees while training: per-instruction timers (wall_clock_breakdown), MFU (of the model FLOPs
`megazero.core.flops` counts), the one-screen start summary, and the JSON-lines metrics file.
"""
from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Mapping

import torch

from megazero.core import instructions as I

CATEGORY = {
    I.Forward: "forward", I.Backward: "backward", I.BackwardInput: "backward", I.BackwardWeight: "backward",
    I.SendAct: "pipeline_p2p", I.RecvAct: "pipeline_p2p", I.SendGrad: "pipeline_p2p", I.RecvGrad: "pipeline_p2p",
    I.ReduceGrads: "dp_reduction", I.OptimizerStep: "optimizer", I.LoadMicroBatch: "data",
}


class Timers:
    """Accumulates seconds per category from the executor's per-instruction callback; optionally
    forwards every event to a tracer."""

    def __init__(self, tracer=None):
        self.totals: dict[str, float] = defaultdict(float)
        self.tracer = tracer

    def __call__(self, ins, start: float, end: float) -> None:
        self.totals[CATEGORY.get(type(ins), "other")] += end - start
        if self.tracer is not None:
            self.tracer.event(ins, start, end)

    def pop(self) -> dict[str, float]:
        """Seconds per category since the last pop (milliseconds in the report)."""
        out = {k: round(v * 1000, 2) for k, v in sorted(self.totals.items())}
        self.totals.clear()
        return out


def comm_delta(before: dict, after: dict) -> dict:
    """What a step moved: {"axis/op": {"bytes", "inter_node_bytes"}} between two `CommStats.snapshot`s
    (entries that moved nothing left out)."""
    out = {}
    for key, now in after.items():
        was = before.get(key, {})
        moved = {k: now[k] - was.get(k, 0.0) for k in ("bytes", "inter_node_bytes")}
        if moved["bytes"]:
            out[key] = moved
    return out


def mfu(flops_per_step: float, step_time_s: float, devices: int, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: flops / (time x devices x peak); None without a configured peak."""
    if not peak_tflops or step_time_s <= 0:
        return None
    return flops_per_step / (step_time_s * devices * peak_tflops * 1e12)


class MetricsWriter:
    """One JSON object per optimizer step, appended to `path` (rank 0 only)."""

    def __init__(self, path: str | None, resume_step: int | None = None):
        """A resumed run (`resume_step`) keeps the records of steps <= resume_step and appends; a new
        run starts the file afresh."""
        self.path = path
        self._f = None
        if not path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        kept = []
        if resume_step is not None and os.path.exists(path):
            with open(path) as f:
                kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= resume_step]
        self._f = open(path, "w")
        self._f.writelines(kept)
        self._f.flush()

    def write(self, record: dict) -> None:
        """`record` as one line; a mapping that is not a dict (the MoE statistics, read on the host
        only now: `megazero.moe.stats.MoEStepStats`) is written as one."""
        if self._f is not None:
            self._f.write(json.dumps(record, sort_keys=True, default=_as_dict) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def _as_dict(value):
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n}"


class PendingSteps:
    """The metrics of the steps trained since the last flush, whose device values (loss, grad norm)
    are read on the host only at `flush`: one synchronisation for all of them, so a GPU is waited for
    at log intervals, not every step (Megatron-LM logs likewise). Step times are host times between
    flushes: between them the host may run ahead of the device, so each step of a flushed run gets
    their mean (exact per step with a flush every step). No communication."""

    def __init__(self, tokens_per_step: float, flops_per_step: float, devices: int, peak_tflops: float | None):
        self.tokens, self.flops, self.devices, self.peak = tokens_per_step, flops_per_step, devices, peak_tflops
        self.records: list[tuple[dict, dict]] = []
        self.clock = StepClock()

    def add(self, record: dict, device_values: dict) -> None:
        """`record` (host values) of one step, and its `device_values` {key: 0-d tensor or float or None}."""
        self.records.append((record, device_values))

    def flush(self) -> list[dict]:
        """The pending records complete (device values read, timing filled in), oldest first; resets."""
        if not self.records:
            return []
        dt = self.clock.lap() / len(self.records)
        keys = [(i, k) for i, (_, values) in enumerate(self.records) for k, v in values.items()
                if v is not None and not isinstance(v, (int, float))]
        read = torch.stack([self.records[i][1][k].double().reshape(()) for i, k in keys]).tolist() if keys else []
        found = dict(zip(keys, read))
        out = []
        for i, (record, values) in enumerate(self.records):
            for k, v in values.items():
                record[k] = found.get((i, k), v)
            record.update({"tokens_per_s": self.tokens / dt, "step_time_s": dt,
                           "mfu": mfu(self.flops, dt, self.devices, self.peak)})
            out.append(record)
        self.records = []
        return out


class StepClock:
    def __init__(self):
        self.t = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt
