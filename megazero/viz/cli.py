"""``python -m megazero.viz`` (= ``python tools/visualize_schedule.py``): draw a pipeline schedule.

    python -m megazero.viz --schedule 1f1b --stages 4 --microbatches 8            # text grid
    python -m megazero.viz --schedule interleaved -p 4 -m 8 -v 2 --out s.svg      # planned, unit costs
    python -m megazero.viz --schedule zb-h1 -p 16 -m 64 --costs 1,1,1,0.1 --out s.html
    python -m megazero.viz --config configs/demo.yaml parallel.dp=4 --hardware h100-80gb --out p.svg
    python -m megazero.viz --run runs/demo --out measured.html                     # a run's last step
    python -m megazero.viz --run runs/demo --compare --out compare.html            # planned over measured
    python -m megazero.viz --run runs/demo --compare --config configs/demo.yaml parallel.dp=2 --out c.svg
    python -m megazero.viz --schedule 1f1b -p 4 -m 8 --chrome-trace s.json         # for Perfetto

What is drawn:
- `--schedule NAME|FILE.csv` (or the positional name) with `--stages/-p`, `--microbatches/-m`,
  `--chunks/-v` and `--costs F,B,W[,P2P]`: the planned step from the simulator (unit costs by default:
  F = B = W = 1, free p2p; a full backward costs B + W);
- `--config CONFIG [key=value ...]`: the schedule that training config runs, every instruction timed
  by the planner for its model on `--hardware` (a preset of configs/hardware/ or a YAML), in ms, with
  each stage's activation bytes at its peak. Without parallel.dp in the config, give `--world-size`;
- `--run RUN_DIR`: the measured step (`--step`, default the last) of the ranks at `--dp-rank`,
  `--tp-rank` of every stage, from the run's traces (trace.enabled=true); p2p bars are the time a
  rank spent in a send or receive, mostly waiting for its peer;
- `--run RUN_DIR --compare`: the plan above the measurement, per stage, on one time axis, with both
  bubbles and where they differ most. The plan is the executed programs simulated with the run's
  mean measured costs, or with `--config`, the planner's prediction for that config.

Outputs: `--out FILE.svg|.html|.png|.pdf` (PNG and PDF need matplotlib: ``pip install megazero[viz]``),
`--chrome-trace FILE.json` (Perfetto, chrome://tracing), `--format text` (the character grid; the
default when nothing is written). `--trace DIR` prints the older per-rank text grid of a trace folder.

Bad input (an unknown schedule, sizes the schedule cannot run, a run directory without traces, a
config whose layout does not fit, ...) prints one line on stderr and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from megazero.core.config.errors import ConfigError
from megazero.core.config.loading import load_config
from megazero.core.instructions import ScheduleError
from megazero.core.schedules import SCHEDULES
from megazero.core.simulate import Costs
from megazero.core.spec import SpecError
from megazero.planner.hardware import load_hardware
from megazero.planner.layout import PlanError
from megazero.viz.chrome import chrome_trace
from megazero.viz.compare import Comparison, compare
from megazero.viz.html import render_html
from megazero.viz.measured import MeasuredStep, TraceError, trace_files
from megazero.viz.raster import MissingExtra, render_raster
from megazero.viz.sources import planned, planned_for, predicted
from megazero.viz.svg import render_svg
from megazero.viz.text import LEGEND, cell, column_time, render_text

SUFFIXES = (".svg", ".html", ".png", ".pdf")


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
    if not all(v == v and v != float("inf") for v in values) or values[0] <= 0 or values[1] <= 0 or min(values) < 0:
        raise UsageError(f"--costs {text!r}: F and B must be > 0, W and P2P >= 0 (finite)")
    return Costs(forward=values[0], backward_input=values[1], backward_weight=values[2],
                 p2p=values[3] if len(values) == 4 else 0.0)


def trace_grid(trace_dir: str, width: int, step: int | None) -> tuple[list[str], str]:
    """`--trace`: one text row per rank (every rank, not one per stage) of a step, `width` columns."""
    try:
        files = trace_files(trace_dir, "--trace")
        traces = []
        for f in files:
            with open(f) as handle:
                traces.append(json.load(handle))
        events = [[e for e in t["traceEvents"] if e.get("ph") == "X"] for t in traces]
        steps = sorted({e["args"]["step"] for ev in events for e in ev})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--trace {trace_dir!r}: not a folder of megazero traces ({type(exc).__name__}: {exc})") from None
    step = steps[-1] if step is None and steps else step
    chosen = [[e for e in ev if e["args"]["step"] == step] for ev in events]
    if not any(chosen):
        raise UsageError(f"--trace {trace_dir!r}: no events of step {step}" + (f"; steps {steps[0]}..{steps[-1]}" if steps else ""))
    t0 = min(e["ts"] for ev in chosen for e in ev)
    t1 = max(e["ts"] + e["dur"] for ev in chosen for e in ev)
    scale = width / max(t1 - t0, 1e-9)
    rows = []
    for t, ev in zip(traces, chosen):
        row = ["."] * width
        for e in ev:
            kind = e["name"][0]
            if kind in "FBW" and e["name"][1:2].isdigit():
                a = int((e["ts"] - t0) * scale)
                b = max(int((e["ts"] + e["dur"] - t0) * scale), a + 1)
                for x in range(a, min(b, width)):
                    row[x] = cell(kind, int(e["args"]["mb"]))
        meta = t["metadata"]
        rows.append(f"r{meta['rank']:<2} s{meta['stage']} " + "".join(row))
    return rows, f"measured step {step}: {(t1 - t0) / 1000:.1f} ms over {width} columns"


def drawn_in_time(timelines) -> bool:
    """Timelines in ms (predicted, measured) get at most --width columns; planned unit grids do not."""
    return any(t.unit for t in timelines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="visualize_schedule", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    names = " | ".join(SCHEDULES + ("FILE.csv",))
    ap.add_argument("schedule", nargs="?", default=None, help=f"{names} (default 1f1b; or --schedule)")
    ap.add_argument("--schedule", "-s", dest="schedule_opt", default=None, metavar="NAME", help=names)
    ap.add_argument("--stages", "-p", type=int, default=4)
    ap.add_argument("--microbatches", "-m", type=int, default=8)
    ap.add_argument("--chunks", "-v", type=int, default=1)
    ap.add_argument("--costs", default=None, metavar="F,B,W[,P2P]", help="durations (default 1,1,1,0)")
    ap.add_argument("--config", nargs="+", default=None, metavar=("CONFIG", "KEY=VALUE"),
                    help="a training config (and overrides): draw the planner's prediction of its step")
    ap.add_argument("--world-size", type=int, default=None, help="with --config: ranks, when parallel.dp is unset")
    ap.add_argument("--hardware", default="h100-80gb", help="with --config: a preset of configs/hardware/ or a YAML "
                    "file (default h100-80gb)")
    ap.add_argument("--run", default=None, metavar="RUN_DIR", help="a run directory with trace/rank*.json")
    ap.add_argument("--compare", action="store_true", help="with --run: the plan (or --config's prediction) "
                    "above the measured step")
    ap.add_argument("--step", type=int, default=None, help="with --run or --trace: which step (default: the last)")
    ap.add_argument("--dp-rank", type=int, default=0, help="with --run: the dp rank drawn for each stage")
    ap.add_argument("--tp-rank", type=int, default=0, help="with --run: the tp rank drawn for each stage")
    ap.add_argument("--out", "-o", default=None, metavar="FILE.svg|.html|.png|.pdf", help="write a picture")
    ap.add_argument("--chrome-trace", default=None, metavar="FILE.json", help="write a Perfetto / Chrome trace")
    ap.add_argument("--format", choices=("text",), default=None, help="print the text grid (the default "
                    "when nothing is written)")
    ap.add_argument("--trace", help="a trace directory: the per-rank text grid of a step")
    ap.add_argument("--width", type=int, default=120, help="columns of a measured text grid")
    return ap


def _schedule_name(args: argparse.Namespace) -> str:
    if args.schedule and args.schedule_opt and args.schedule != args.schedule_opt:
        raise UsageError(f"two schedules given: {args.schedule!r} and --schedule {args.schedule_opt!r}")
    return args.schedule_opt or args.schedule or "1f1b"


def _write(path: str, write) -> None:
    try:
        write(path)
    except OSError as exc:
        raise UsageError(f"cannot write {path!r}: {exc.strerror}") from None
    print(f"wrote {path}")


def _text_file(text: str):
    def write(path: str) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    return write


def _config_timeline(args: argparse.Namespace, hardware_dir: str):
    path, overrides = args.config[0], args.config[1:]
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise UsageError(f"--config {path} {' '.join(overrides)}: {bad[0]!r} is not key=value")
    cfg = load_config(path, overrides, world_size=args.world_size)
    if cfg.parallel.dp is None:
        raise UsageError(f"--config {path}: parallel.dp is unset; give --world-size N (the ranks the launcher "
                         f"starts) or parallel.dp=N")
    if cfg.model.spec is None:
        raise UsageError(f"--config {path}: model.spec is unset; the planner needs the model")
    return predicted(cfg, load_hardware(args.hardware, hardware_dir))


def _check_args(args: argparse.Namespace) -> str | None:
    """The output suffix; UsageError for options that do not go together."""
    suffix = os.path.splitext(args.out)[1].lower() if args.out else None
    if args.out and suffix not in SUFFIXES:
        raise UsageError(f"--out {args.out!r}: the picture must be FILE.svg, FILE.html, FILE.png or FILE.pdf")
    if args.compare and not args.run:
        raise UsageError("--compare needs --run RUN_DIR (the measured step to compare with)")
    planned_given = args.schedule or args.schedule_opt or args.costs
    if (args.config or args.run) and planned_given:
        raise UsageError("--schedule/--costs draw a planned schedule; --config and --run take the schedule "
                         "from the config or the run")
    if args.config and args.run and not args.compare:
        raise UsageError("--config with --run needs --compare (the prediction above the measurement)")
    return suffix


def picture(args: argparse.Namespace, hardware_dir: str):
    """The `Timeline` or `Comparison` the arguments ask for."""
    if args.run:
        step = MeasuredStep.load(args.run, args.step, args.dp_rank, args.tp_rank)
        measured = step.timeline()
        if not args.compare:
            return measured
        plan = _config_timeline(args, hardware_dir) if args.config else planned_for(step)
        if plan.num_stages != measured.num_stages:
            raise UsageError(f"--config has {plan.num_stages} pipeline stages, the run {measured.num_stages}")
        return compare(plan, measured)
    if args.config:
        return _config_timeline(args, hardware_dir)
    costs = parse_costs(args.costs)
    return planned(_schedule_name(args), args.stages, args.microbatches, args.chunks, costs)


def run(args: argparse.Namespace, hardware_dir: str = "configs/hardware") -> None:
    """Everything after argument parsing; bad input raises one of `main`'s one-line errors."""
    if args.trace:
        rows, info = trace_grid(args.trace, args.width, args.step)
        print("\n".join([info] + rows + [LEGEND]))
        return
    suffix = _check_args(args)
    drawn = picture(args, hardware_dir)
    writes_nothing = not (args.out or args.chrome_trace)
    if args.format == "text" or writes_nothing:
        timelines = [drawn.plan, drawn.run] if isinstance(drawn, Comparison) else [drawn]
        width = args.width if drawn_in_time(timelines) else None
        unit = max(column_time(t, width) for t in timelines)  # one time axis for a plan and its run
        print("\n".join(render_text(t, unit=unit) for t in timelines))
    if args.out:
        if suffix in (".png", ".pdf"):
            _write(args.out, lambda path: render_raster(drawn, path))
        else:
            text = render_svg(drawn) if suffix == ".svg" else render_html(drawn)
            _write(args.out, _text_file(text))
    if args.chrome_trace:
        _write(args.chrome_trace, _text_file(json.dumps(chrome_trace(drawn))))
    if not writes_nothing:
        print(drawn.summary())


ERRORS = (UsageError, ScheduleError, ConfigError, PlanError, SpecError, TraceError, MissingExtra)


def default_hardware_dir() -> str:
    """``configs/hardware`` of the working directory, else of the checkout megazero is installed from."""
    if os.path.isdir(os.path.join("configs", "hardware")):
        return os.path.join("configs", "hardware")
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "configs", "hardware")


def main(argv=None, hardware_dir: str | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        run(args, hardware_dir or default_hardware_dir())
    except ERRORS as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"visualize_schedule: {first}", file=sys.stderr)
        return 2
    return 0


__all__ = ["ERRORS", "UsageError", "main", "parse_costs", "parser", "picture", "run", "trace_grid"]
