#!/usr/bin/env python
"""Draw pipeline schedules as text timelines: planned (from the simulator) or measured (from traces).

    python tools/visualize_schedule.py 1f1b --stages 4 --microbatches 8
    python tools/visualize_schedule.py interleaved --stages 4 --microbatches 8 --chunks 2
    python tools/visualize_schedule.py --trace runs/demo/trace      # measured, one row per rank

One row per pipeline stage (measured: per rank), one column per time unit (planned: unit costs
t_F = t_B = t_W = 1, so a full backward is 2 columns; measured: --width columns over the step).
A cell shows what runs then: forward of micro-batch n as 0-9 then a-z, backward of micro-batch n
as A-Z (A = micro-batch 0), the zero-bubble weight-grad pass as w, and idle time (the bubble) as '.'.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from megazero.core import instructions as I
from megazero.core.schedules import SCHEDULES, get_schedule
from megazero.core.simulate import simulate

FWD = "0123456789abcdefghijklmnopqrstuvwxyz"
BWD = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def cell(kind: str, mb: int) -> str:
    if kind == "F":
        return FWD[mb % len(FWD)]
    if kind == "B":
        return BWD[mb % len(BWD)]
    return "w"


def planned(name: str, p: int, m: int, v: int) -> tuple[list[str], str]:
    result = simulate(get_schedule(name, p, m, v))
    width = int(round(result.makespan))
    rows = []
    for spans in result.timeline:
        row = ["."] * width
        for span in spans:
            ins = span.instr
            if isinstance(ins, I.COMPUTE):
                kind = "F" if isinstance(ins, I.Forward) else "W" if isinstance(ins, I.BackwardWeight) else "B"
                for t in range(int(round(span.start)), int(round(span.end))):
                    row[t] = cell(kind, ins.mb)
        rows.append("".join(row))
    info = (f"{name}: p={p} m={m} v={v}  makespan {result.makespan:g}  bubble {result.bubble_fraction:.1%} of the "
            f"step  peak in-flight micro-batches per stage {list(result.peak_inflight)}")
    return rows, info


def measured(trace_dir: str, width: int, step: int | None) -> tuple[list[str], str]:
    files = sorted(glob.glob(os.path.join(trace_dir, "rank*.json")), key=lambda f: int(f.rsplit("rank", 1)[1][:-5]))
    if not files:
        raise SystemExit(f"visualize_schedule: no rank*.json under {trace_dir!r} (run with trace.enabled=true)")
    traces = [json.load(open(f)) for f in files]
    events = [[e for e in t["traceEvents"] if e.get("ph") == "X"] for t in traces]
    last = max(e["args"]["step"] for ev in events for e in ev)
    step = last if step is None else step
    chosen = [[e for e in ev if e["args"]["step"] == step] for ev in events]
    t0 = min(e["ts"] for ev in chosen for e in ev)
    t1 = max(e["ts"] + e["dur"] for ev in chosen for e in ev)
    scale = width / (t1 - t0)
    rows = []
    for t, ev in zip(traces, chosen):
        row = ["."] * width
        for e in ev:
            kind = e["name"][0]
            if kind in "FBW" and e["name"][1:2].isdigit():
                a, b = int((e["ts"] - t0) * scale), max(int((e["ts"] + e["dur"] - t0) * scale), int((e["ts"] - t0) * scale) + 1)
                for x in range(a, min(b, width)):
                    row[x] = cell(kind, int(e["args"]["mb"]))
        meta = t["metadata"]
        rows.append(f"r{meta['rank']:<2} s{meta['stage']} " + "".join(row))
    return rows, f"measured step {step}: {(t1 - t0) / 1000:.1f} ms over {width} columns"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Draw a pipeline schedule as text")
    ap.add_argument("schedule", nargs="?", default="1f1b", help=" | ".join(SCHEDULES + ("FILE.csv",)))
    ap.add_argument("--stages", "-p", type=int, default=4)
    ap.add_argument("--microbatches", "-m", type=int, default=8)
    ap.add_argument("--chunks", "-v", type=int, default=1)
    ap.add_argument("--trace", help="a run's trace directory: draw the measured timeline instead")
    ap.add_argument("--step", type=int, default=None, help="with --trace: which step (default: the last)")
    ap.add_argument("--width", type=int, default=120)
    args = ap.parse_args(argv)
    if args.trace:
        rows, info = measured(args.trace, args.width, args.step)
    else:
        rows, info = planned(args.schedule, args.stages, args.microbatches, args.chunks)
        rows = [f"stage {s} {r}" for s, r in enumerate(rows)]
    print(info)
    print("\n".join(rows))
    print("legend: 0-9a-z forward of micro-batch n, A-Z backward (input grad, or full) of micro-batch n, "
          "w weight-grad pass (zero bubble), . idle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
