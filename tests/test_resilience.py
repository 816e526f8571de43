"""Runs that survive their cluster (README "Running for weeks"), on real failures: a rank process SIGKILLed
under torchrun, whose agent restarts the job by itself.

Covers: a 2x2x2 run with asynchronous saves every 5 steps under ``torchrun --max-restarts=2`` loses a
random rank at a random step and finishes by itself, its per-step metrics bit-identical to an uninterrupted
run's (the restart resumes from the newest complete checkpoint); the new attempt's process group does not
read the dead attempt's keys from the agent's store (`megazero.run.launch.attempt_store`).
"""
import json
import os
import random
import re

from tests.faults import Job

TIMING = {"tokens_per_s", "step_time_s", "mfu", "time_ms"}


def _metrics(path):
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]


def _train_args(corpus, run_dir, steps):
    return ["-m", "megazero.run.train", "configs/debug_gpt.yaml", f"data.path={corpus}", f"run_dir={run_dir}",
            f"train.steps={steps}", "log.interval=1", "model.layers=4", "model.seq_len=32",
            "checkpoint.save_interval=5", "checkpoint.async_save=true"]


def test_a_killed_rank_restarts_the_job_and_resumes_exactly(corpus, tmp_path):
    """One of 8 ranks (pp2 x tp2 x dp2) SIGKILLed at a random step: every rank stops, torchrun starts a new
    attempt, which resumes from the newest complete checkpoint; the finished run's metrics equal an
    uninterrupted run's, bit for bit (floats compared as written)."""
    rng = random.Random(34)
    victim, at_step, steps = rng.randrange(8), rng.randint(6, 11), 14
    launch = ["--standalone", "--nproc_per_node=8"]
    whole = Job([*launch, *_train_args(corpus, tmp_path / "whole", steps)], str(tmp_path / "whole.log"))
    assert whole.wait(600) == 0, whole.output()[-3000:]

    job = Job([*launch, "--max-restarts=2", *_train_args(corpus, tmp_path / "run", steps)],
              str(tmp_path / "run.log"))
    metrics = str(tmp_path / "run" / "metrics.jsonl")
    seen = job.wait_for_step(metrics, at_step)
    job.kill_rank(victim)
    code = job.wait(600)
    out = job.output()
    assert code == 0, out[-4000:]
    assert f"failed (exitcode: -9) local_rank: {victim}" in out, out[-3000:]  # the kill, as torchrun saw it
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", out)]
    assert len(resumed) == 1 and resumed[0] in (5, 10), out[-3000:]
    assert seen - resumed[0] <= 2 * 5  # the work lost: steps since the newest complete checkpoint
    got, want = _metrics(metrics), _metrics(tmp_path / "whole" / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert got == want
