"""Side-by-side benchmarks of megazero against its peers (DeepSpeed, torch DDP / FSDP2 / pipelining,
torch's AdamW), installed by `pip install -e .[bench]`.

    python benchmarks/run.py [--only NAME ...] [--repeats N] [--tiny] --json OUT.json

Cases (benchmarks/cases/<name>.py): cpu_adam, zero_step, pipeline_step, peak_memory, scaling, comm_options,
gpu.
Each case runs its contestants interleaved (A/B/A/B) after warm-up, checks that megazero and the
peer computed the same thing before it reports a ratio (megazero / peer, per repeat pair; then
median and min-max), and records why a peer could not run. Writes OUT.json (machine info and
every case's results) and OUT.md (the markdown table, also printed). `--tiny` shrinks every case
to seconds (the smoke test uses it). No wall-clock asserts: the numbers are reported, not judged.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _common as C  # noqa: E402


def gpu_case(args) -> dict:
    """The GPU hook: where CUDA is available, run tools/gpu_check.sh (if present) with this interpreter
    and record its outcome and the JSON files it wrote; the GPU training benchmark proper is still to
    be written here (another engineer's task). Without CUDA: "skipped: no CUDA device"."""
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device", "rows": [{"case": "gpu", "what": "-", "check": "skipped: no CUDA device"}]}
    script = C.ROOT / "tools" / "gpu_check.sh"
    out = {"device": torch.cuda.get_device_name(0), "gpu_training_benchmark": "not written yet"}
    if not script.exists():
        out["gpu_check"] = "tools/gpu_check.sh not found"
    else:
        dest = Path(os.environ.get("OUT") or C.ROOT / "runs" / "gpu_check")
        start = time.perf_counter()
        proc = subprocess.run(["bash", str(script)], cwd=C.ROOT, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "PYTHON": sys.executable, "OUT": str(dest)})
        out["gpu_check"] = {"returncode": proc.returncode, "seconds": round(time.perf_counter() - start, 1),
                            "outputs": str(dest), "output_tail": (proc.stdout + proc.stderr)[-4000:]}
        for f in sorted(dest.glob("*.json")) if dest.is_dir() else []:
            try:
                out["gpu_check"][f.name] = json.loads(f.read_text())
            except ValueError as err:
                out["gpu_check"][f.name] = f"unreadable: {err}"
    status = out["gpu_check"] if isinstance(out["gpu_check"], str) else f"gpu_check.sh rc {out['gpu_check']['returncode']}"
    out["rows"] = [{"case": "gpu", "what": out["device"], "check": status}]
    return out


def _cases() -> dict:
    from benchmarks.cases import comm_options, cpu_adam, peak_memory, pipeline_step, scaling, zero_step

    return {"cpu_adam": cpu_adam.case, "zero_step": zero_step.case, "pipeline_step": pipeline_step.case,
            "peak_memory": peak_memory.case, "scaling": scaling.case, "comm_options": comm_options.case,
            "gpu": gpu_case}


def main(argv=None) -> int:
    cases = _cases()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=sorted(cases), metavar="NAME",
                    help=f"run only these cases ({', '.join(cases)})")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per contestant (default 3)")
    ap.add_argument("--tiny", action="store_true", help="shrink every case to seconds (smoke test)")
    ap.add_argument("--json", required=True, help="output JSON path; the markdown table goes next to it (.md)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    chosen = args.only or list(cases)
    report = {"benchmark": "megazero vs peers", "argv": sys.argv[1:], "repeats": args.repeats, "tiny": args.tiny,
              "machine": C.machine_info(), "cases": {}}
    start = time.perf_counter()
    for name in chosen:
        t0 = time.perf_counter()
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        try:
            result = cases[name](args)
        except Exception as err:  # noqa: BLE001 - one broken case must not lose the others
            result = {"error": C.failure(err), "traceback": traceback.format_exc()[-3000:]}
        result["seconds"] = round(time.perf_counter() - t0, 1)
        report["cases"][name] = result
        print(f"[bench] {name} done in {result['seconds']} s", file=sys.stderr, flush=True)
    report["total_seconds"] = round(time.perf_counter() - start, 1)
    report["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    table = C.markdown(report["cases"], report["machine"]) + f"\ntotal: {report['total_seconds']} s\n"
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
