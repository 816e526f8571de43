"""`bash tools/gpu_check.sh --cpu`: the dry run of the GPU check runs every stage end to end on CPU with
tiny shapes and writes one JSON per stage with what the GPU run would report."""
import json
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_cpu_dry_run_writes_every_stage(tmp_path):
    out = tmp_path / "check"
    env = dict(os.environ, OUT=str(out), PYTHON=str(Path(os.sys.executable)))
    start = time.perf_counter()
    proc = subprocess.run(["bash", "tools/gpu_check.sh", "--cpu"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    took = time.perf_counter() - start
    log = (out / "log.txt").read_text() if (out / "log.txt").exists() else proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert took < 180, took
    stages = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert set(stages) == {"env", "kernels", "trainer", "plain", "planner"}, sorted(stages)
    assert not any("error" in s for s in stages.values()), {k: s.get("error") for k, s in stages.items()}
    assert stages["kernels"]["skipped"].startswith("no CUDA")
    trainer = stages["trainer"]
    assert trainer["flash"]["confirmed"] and trainer["flash"]["flash_kernels"]
    for run in ("zero1", "resume", "zero3_offload"):
        r = trainer[run]
        assert r["exit_code"] == 0 and r["peak_memory_bytes"] > 0 and r["tokens_per_s"] > 0
        assert r["host_syncs"]["per_step"] > 0 and r["host_syncs"]["by_site"]
    # the trainer reads the device twice per step here (log.interval 1: the flush, and the norm)
    assert trainer["zero1"]["host_syncs"]["per_step"] == 2, trainer["zero1"]["host_syncs"]
    assert trainer["resume"]["equal_to_uninterrupted"], (trainer["resume"]["losses"], trainer["zero1"]["losses"])
    assert trainer["resume"]["steps"][0] == trainer["resume"]["resumed_at"] + 1
    plain = stages["plain"]
    assert plain["model"] == "transformers.LlamaForCausalLM" and all(x == x for x in plain["losses"])
    planner = stages["planner"]
    assert planner["memory_bytes"] > 0 and planner["step_time_s"] > 0 and "ratio_predicted_over_measured" in planner
