#!/usr/bin/env python
"""Draw pipeline schedules: planned (from the simulator) as text, SVG, HTML or a Chrome trace; measured
(from a run's traces) as text.

    python tools/visualize_schedule.py 1f1b --stages 4 --microbatches 8
    python tools/visualize_schedule.py --schedule interleaved --stages 4 --microbatches 8 --chunks 2 --out s.svg
    python tools/visualize_schedule.py --schedule zb-h1 -p 16 -m 64 --costs 1,1,1,0.1 --out s.html
    python tools/visualize_schedule.py --schedule 1f1b -p 4 -m 8 --chrome-trace s.json   # Perfetto
    python tools/visualize_schedule.py --trace runs/demo/trace      # measured, one row per rank

`--costs F,B,W[,P2P]` are the durations of a forward, an input-grad backward, a weight-grad backward
(a full backward costs B + W) and one transfer (default 1,1,1,0); the schedule's transfer order is
built for them and the simulator runs with them. `--out` writes FILE.svg or FILE.html (megazero.viz);
without --out or --chrome-trace (or with --format text) the text grid is printed:

One row per pipeline stage (measured: per rank), one column per time unit (planned: unit costs
t_F = t_B = t_W = 1, so a full backward is 2 columns; measured: --width columns over the step).
A cell shows what runs then: forward of micro-batch n as 0-9 then a-z, backward of micro-batch n
as A-Z (A = micro-batch 0), the zero-bubble weight-grad pass as w, and idle time (the bubble) as '.'.

Bad input (an unknown schedule, sizes the schedule cannot run, bad --costs, an --out that is not
.svg or .html) prints one line on stderr and exits with status 2.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from megazero.core.instructions import ScheduleError
from megazero.core.schedules import SCHEDULES, get_schedule
from megazero.core.simulate import Costs, simulate
from megazero.viz.chrome import chrome_trace
from megazero.viz.html import render_html
from megazero.viz.svg import render_svg
from megazero.viz.text import LEGEND, cell, render_text
from megazero.viz.timeline import Timeline, from_simulation

WRITERS = {".svg": render_svg, ".html": render_html}


class UsageError(ValueError):
    """Bad command-line input: printed as one line, exit status 2."""


def parse_costs(text: str | None) -> Costs | None:
    """``F,B,W[,P2P]`` -> Costs (None: unit costs, free p2p). F and B > 0, W and P2P >= 0."""
    if text is None:
        return None
    parts = text.split(",")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise UsageError(f"--costs {text!r}: expected numbers F,B,W[,P2P] such as 1,1,1 or 1,2,1,0.1") from None
    if len(values) not in (3, 4):
        raise UsageError(f"--costs {text!r}: expected 3 or 4 numbers F,B,W[,P2P], got {len(values)}")
    if not all(v == v and v not in (float("inf"),) for v in values) or values[0] <= 0 or values[1] <= 0 \
            or min(values) < 0:
        raise UsageError(f"--costs {text!r}: F and B must be > 0, W and P2P >= 0 (finite)")
    return Costs(forward=values[0], backward_input=values[1], backward_weight=values[2],
                 p2p=values[3] if len(values) == 4 else 0.0)


def planned_timeline(name: str, p: int, m: int, v: int, costs: Costs | None = None) -> Timeline:
    """The simulated step of schedule `name` (or a .csv) as a Timeline; ScheduleError on bad sizes."""
    result = simulate(get_schedule(name, p, m, v, costs), costs)
    return from_simulation(result, f"{name}: p={p} m={m} v={v}")


def planned(name: str, p: int, m: int, v: int, costs: Costs | None = None) -> tuple[list[str], str]:
    """Today's text grid: (rows without the stage prefix, header line)."""
    lines = render_text(planned_timeline(name, p, m, v, costs)).split("\n")
    return [row.split(" ", 2)[2] for row in lines[1:-1]], lines[0]


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


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Draw a pipeline schedule (text, SVG, HTML, Chrome trace)")
    names = " | ".join(SCHEDULES + ("FILE.csv",))
    ap.add_argument("schedule", nargs="?", default=None, help=f"{names} (default 1f1b; or --schedule)")
    ap.add_argument("--schedule", "-s", dest="schedule_opt", default=None, metavar="NAME", help=names)
    ap.add_argument("--stages", "-p", type=int, default=4)
    ap.add_argument("--microbatches", "-m", type=int, default=8)
    ap.add_argument("--chunks", "-v", type=int, default=1)
    ap.add_argument("--costs", default=None, metavar="F,B,W[,P2P]", help="durations (default 1,1,1,0)")
    ap.add_argument("--out", "-o", default=None, metavar="FILE.svg|FILE.html", help="write a picture")
    ap.add_argument("--chrome-trace", default=None, metavar="FILE.json", help="write a Perfetto / Chrome trace")
    ap.add_argument("--format", choices=("text",), default=None, help="print the text grid (the default "
                    "when nothing is written)")
    ap.add_argument("--trace", help="a run's trace directory: draw the measured timeline instead")
    ap.add_argument("--step", type=int, default=None, help="with --trace: which step (default: the last)")
    ap.add_argument("--width", type=int, default=120)
    return ap


def _schedule_name(args: argparse.Namespace) -> str:
    if args.schedule and args.schedule_opt and args.schedule != args.schedule_opt:
        raise UsageError(f"two schedules given: {args.schedule!r} and --schedule {args.schedule_opt!r}")
    return args.schedule_opt or args.schedule or "1f1b"


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as exc:
        raise UsageError(f"cannot write {path!r}: {exc.strerror}") from None
    print(f"wrote {path}")


def run(args: argparse.Namespace) -> None:
    """Everything after argument parsing; bad input raises UsageError or ScheduleError."""
    if args.trace:
        rows, info = measured(args.trace, args.width, args.step)
        print("\n".join([info] + rows + [LEGEND]))
        return
    suffix = os.path.splitext(args.out)[1].lower() if args.out else None
    if args.out and suffix not in WRITERS:
        raise UsageError(f"--out {args.out!r}: the picture must be FILE.svg or FILE.html")
    costs = parse_costs(args.costs)
    timeline = planned_timeline(_schedule_name(args), args.stages, args.microbatches, args.chunks, costs)
    if args.format == "text" or not (args.out or args.chrome_trace):
        print(render_text(timeline))
    if args.out:
        _write(args.out, WRITERS[suffix](timeline))
    if args.chrome_trace:
        _write(args.chrome_trace, json.dumps(chrome_trace(timeline)))
    if args.out or args.chrome_trace:
        print(timeline.summary())


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        run(args)
    except (UsageError, ScheduleError) as exc:
        print(f"visualize_schedule: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
