"""The planner against every published run it is validated on (`megazero.planner.validation.POINTS`, none
fitted) and the Table-1 rows (the five it is fitted on, the five larger ones predicted): docs/planning.md's
validation table.

    python benchmarks/planner_published.py [--json OUT.json]

Prints the markdown table (predicted, published, error) and writes the rows as JSON. Pure planner: no
processes, no GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megazero.planner.hardware import load_hardware  # noqa: E402
from megazero.planner.memory_plan import predict_memory  # noqa: E402
from megazero.planner.published import CALIBRATION, JUDGE, predict_published  # noqa: E402
from megazero.planner.speed import predict_step  # noqa: E402
from megazero.planner.validation import POINTS  # noqa: E402

HARDWARE = Path(__file__).resolve().parents[1] / "configs" / "hardware"
UNITS = {"hardware_tflops": ("TFLOP/s per GPU", "{:.1f}"), "step_s": ("s per step", "{:.2f}"), "mfu": ("MFU", "{:.1%}")}


def rows() -> list[dict]:
    out = []
    a100 = load_hardware("a100-80gb", str(HARDWARE))
    for run, fitted in [(r, True) for r in CALIBRATION] + [(r, False) for r in JUDGE]:
        got = predict_published(run, a100).hardware_tflops_per_gpu
        out.append({"name": f"{run.params_b}B, tp{run.tp} pp{run.pp} dp{run.dp}", "source": "Narayanan et al. 2021, Table 1",
                    "fitted": fitted, "metric": "hardware_tflops", "published": run.tflops_per_gpu, "predicted": got,
                    "error": got / run.tflops_per_gpu - 1, "assumed": ""})
    for p in POINTS:
        hw = load_hardware(p.hardware, str(HARDWARE))
        step = predict_step(p.spec, p.layout, hw, implementation=p.implementation)
        got = {"hardware_tflops": step.hardware_tflops_per_gpu, "step_s": step.step_time_s, "mfu": step.mfu}[p.metric]
        mem = predict_memory(p.spec, p.layout, hardware=hw)
        row = {"name": p.name, "source": p.source, "fitted": False, "metric": p.metric, "published": p.value,
               "predicted": got, "error": got / p.value - 1, "assumed": p.assumed, "gpus": p.layout.gpus,
               "layout": f"tp{p.layout.tp} pp{p.layout.pp} dp{p.layout.dp} mb{p.layout.micro_batch} zero{p.layout.zero} "
                         f"{p.layout.recompute}" + (" sp" if p.layout.sequence_parallel else "")
                         + (f" {p.layout.schedule}:{p.layout.chunks}" if p.layout.schedule == "interleaved" else ""),
               "memory_gb": mem.tightest.total / 1e9, "fits": mem.fits}
        if p.memory_gb is not None:
            row["published_memory_gb"] = p.memory_gb
        out.append(row)
    return out


def markdown(table: list[dict]) -> str:
    lines = ["| run | source | layout | published | predicted | error | predicted memory (GB, tightest stage) | assumed |",
             "|---|---|---|---|---|---|---|---|"]
    for r in table:
        unit, fmt = UNITS[r["metric"]]
        fitted = " (fitted)" if r["fitted"] else ""
        mem = f"{r['memory_gb']:.1f}" + ("" if r.get("fits", True) else " (does not fit)") if "memory_gb" in r else "—"
        if "published_memory_gb" in r:
            mem += f" (published {r['published_memory_gb']:.0f})"
        lines.append(f"| {r['name']}{fitted} | {r['source']} | {r.get('layout', '')} | {fmt.format(r['published'])} {unit} | "
                     f"{fmt.format(r['predicted'])} | {r['error']:+.1%} | {mem} | {r['assumed']} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    table = rows()
    print(markdown(table))
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return table


if __name__ == "__main__":
    main()
