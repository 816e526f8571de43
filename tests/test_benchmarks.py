"""Smoke test of benchmarks/run.py: the zero_step case shrunk to seconds (`--tiny --repeats 1`) writes
a JSON with the machine's facts and, for megazero and each peer, either a step time, an agreement
check and (when it passed) a ratio, or the reason the peer could not run; and the markdown table
next to it. No timing is judged."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_benchmark_runner_writes_results_and_reasons(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--only", "zero_step", "--tiny",
                           "--repeats", "1", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"cpu", "cores", "torch", "deepspeed", "date"} <= set(report["machine"])
    case = report["cases"]["zero_step"]
    assert "error" not in case, case.get("error")
    assert case["results"], case
    for key, res in case["results"].items():
        assert "error" not in res, (key, res["error"])
        assert res["step_s"]["megazero"]["median"] > 0
        peers = [p for p in ("deepspeed", "ddp", "fsdp2", "single") if p in res["step_s"] or p in res["absent"]]
        assert "deepspeed" in peers and "single" in peers, (key, peers)
        for peer in peers:
            if peer in res["absent"]:
                assert res["absent"][peer].strip(), (key, peer)  # says why
                continue
            check = res["checks"][peer]
            assert {"max_rel_diff", "tolerance", "ok"} <= set(check)
            assert check["ok"], (key, peer, check)  # the tiny model agrees within the stated tolerance
            assert res["ratios"][f"megazero/{peer}"]["median"] > 0
    table = out.with_suffix(".md").read_text()
    assert "| case | what | megazero | peer | megazero / peer | check |" in table
    assert "zero_step" in table


def test_comm_options_case_reports_time_and_bytes(tmp_path):
    """benchmarks/run.py --only comm_options --tiny: every option ran against its baseline, its losses
    agreed within the stated tolerance, and the bytes show its saving (hierarchical: 1/1.75 across nodes;
    1-bit Adam: over 16x fewer over dp; hpZ: exact, fewer across nodes; qwZ, qgZ: fewer over dp)."""
    out = tmp_path / "comm.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--only", "comm_options", "--tiny",
                           "--repeats", "1", "--json", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())["cases"]["comm_options"]["results"]
    assert all(r["check"]["ok"] for r in res.values()), res
    # 1 / 1.75 is the two-level byte ratio N(n-1)/(n(N-1)) (tests/test_hierarchical.py); 2e-3 covers the buckets' rounding to whole elements
    assert res["hierarchical"]["internode_bytes_ratio"] == pytest.approx(1 / 1.75, rel=2e-3)
    assert res["onebit_adam"]["dp_bytes_ratio"] < 1 / 16
    assert res["hpZ"]["check"]["max_rel_diff"] == 0 and res["hpZ"]["internode_bytes_ratio"] < 0.6
    assert res["qwZ"]["dp_bytes_ratio"] < 0.6 and res["qgZ"]["dp_bytes_ratio"] < 0.9
