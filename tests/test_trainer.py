"""The trainer as a user runs it: torchrun subprocesses on 127.0.0.1.

Covers: a short run writes metrics (with the documented fields), a checkpoint and traces; the same
run twice gives bit-identical metrics (timing fields aside); bad input (missing config, world size
that does not fit the layout, missing data) ends every rank with one clear line and no hang; a
2-node launch with two torchrun agents on localhost; a restarted run resumes from its checkpoint
exactly, at pp2 x dp2 with dropout; the same-seed check reuses its first two launches (tests/test_checkpoint.py has 2x2x2 and the resharding).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from megazero.core.schedules import get_schedule
from megazero.viz.cli import main as viz_main
from megazero.viz.measured import MeasuredStep
from tests.harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(nproc, args, timeout=180, extra=()):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *extra,
           "-m", "megazero.run.train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def small(corpus, run_dir, *more):
    return [f"data.path={corpus}", f"run_dir={run_dir}", "train.steps=4", "log.interval=2",
            "model.layers=2", *more]


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


TIMING = {"tokens_per_s", "step_time_s", "mfu", "time_ms"}


def test_short_run_writes_metrics_checkpoint_and_trace(corpus, tmp_path):
    run = tmp_path / "run"
    p = torchrun(8, ["configs/debug_gpt.yaml", *small(corpus, run, "checkpoint.save_interval=4", "trace.enabled=true",
                                                    "log.wall_clock_breakdown=true", "log.memory_breakdown=true",
                                                    "zero.stage=2")])
    assert p.returncode == 0, p.stderr[-3000:]
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "lr", "loss_scale", "tokens_per_s", "time_ms"):
        assert all(r[key] is not None for r in rows), key
    assert {"forward", "backward", "pipeline_p2p", "dp_reduction", "optimizer"} <= set(rows[0]["time_ms"])
    # rank 0's bytes of each step by axis and collective: ZeRO-2's gradient reduce-scatters and parameter
    # all-gathers over dp, TP's all-reduces, the pipeline's sends (one node: nothing crosses)
    assert {"dp/reduce_scatter", "dp/all_gather", "tp/all_reduce", "pp/send"} <= set(rows[1]["comm"])
    assert all(v["bytes"] > 0 and v["inter_node_bytes"] == 0 for v in rows[1]["comm"].values())
    assert "layout   pp=2 x tp=2 x dp=2 = 8 ranks, ZeRO-2" in p.stdout
    assert "memory params=" in p.stdout and p.stdout.count("[rank ") == 2  # rank 0 only
    assert sorted(os.listdir(run / "checkpoints" / "step4")) == ["manifest.json"] + sorted(
        f"rank{r}.safetensors" for r in range(8))
    traces = sorted(os.listdir(run / "trace"))
    assert traces == [f"rank{r}.json" for r in range(8)]
    events = json.load(open(run / "trace" / "rank0.json"))["traceEvents"]
    assert {"F0", "B0", "SA0>1", "Reduce", "Step"} <= {e["name"] for e in events}
    # the schedule picture of the last step, planned above measured, and what it was drawn from
    assert (run / "schedule.html").stat().st_size > 0 and (run / "schedule.svg").stat().st_size > 0
    assert f"schedule {run / 'schedule.html'}: step 4 planned vs measured" in p.stdout
    step = MeasuredStep.load(str(run))
    assert step.step == 4 and step.ranks == (0, 4) and step.aligned  # dp rank 0, tp rank 0 of each stage
    assert step.programs == [list(prog) for prog in get_schedule("1f1b", 2, 4, 1)]  # what the ranks executed
    timeline = step.timeline()
    assert sum(b.kind in ("Forward", "Backward") for b in timeline.blocks) == 2 * 2 * 4
    assert all(s.peak_bytes > 0 for s in timeline.stages) and 0 < timeline.bubble < 1
    assert viz_main(["--run", str(run), "--compare", "--out", str(tmp_path / "compare.png")]) == 0


@pytest.mark.parametrize("args, message", [
    (["configs/missing.yaml"], "config file 'configs/missing.yaml' does not exist"),
    (["configs/debug_gpt.yaml", "parallel.tp=4"], "parallel"),
    (["configs/debug_gpt.yaml", "parallel.tp=1", "data.path=/nonexistent/corpus"], "data.path='/nonexistent/corpus'"),
])
def test_bad_input_is_one_clear_line_on_every_rank(args, message):
    p = torchrun(2, args, timeout=120)
    assert p.returncode != 0
    lines = [l for l in p.stderr.splitlines() if l.startswith("megazero.run.train: error:")]
    # each rank validates before any process group exists and says it once (torchrun may stop the
    # others after the first exits, so some may not get to print)
    assert 1 <= len(lines) <= 2, p.stderr[-2000:]
    assert all(message in l for l in lines), lines


def test_two_node_launch_on_localhost(corpus, tmp_path):
    port = free_port()
    common = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
              "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=mz2node"]
    args = ["-m", "megazero.run.train", "configs/debug_gpt.yaml",
            *small(corpus, tmp_path / "run", "parallel.pp=2", "parallel.tp=1", "zero.stage=1")]
    procs = [subprocess.Popen(common + [f"--node_rank={n}"] + args, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert "pp=2 x tp=1 x dp=2 = 4 ranks" in outs[0][0] + outs[1][0]
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == 4


@pytest.fixture(scope="module")
def restarted(corpus, tmp_path_factory):
    """pp2 x dp2, ZeRO-1, dropout 0.1: 8 steps in one go (no checkpoint) in `whole`, and in `run` 4 steps
    with an asynchronous save after step 4, then the same command with train.steps=8, which resumes (4 steps
    on each side of the save: the resumed steps see the restored data position, dropout streams and Adam
    moments past their first step).
    Shared by the same-seed test (the first launch of `run` against `whole`: two launches with the same seed)
    and the resume test, so that the same-seed property costs no launch of its own. dp2 (4 ranks) because
    the same-seed check needs the data-parallel reduction of ZeRO-1 in the run; global batch 8 = micro 2 x 2
    micro-batches x dp 2, so each pipeline step has two micro-batches in flight."""
    root = tmp_path_factory.mktemp("restart")
    args = ["configs/debug_gpt.yaml", "parallel.tp=1", "zero.stage=1", "model.dropout=0.1", "checkpoint.async_save=true",
            "train.global_batch_size=8"]
    whole = torchrun(4, [*args, *small(corpus, root / "whole", "train.steps=8")])
    assert whole.returncode == 0, whole.stderr[-3000:]
    saving = [*args, "checkpoint.save_interval=4"]  # written in the background; the trainer waits at the end
    first = torchrun(4, [*saving, *small(corpus, root / "run", "train.steps=4")])
    assert first.returncode == 0, first.stderr[-3000:]
    first_rows = read_metrics(root / "run" / "metrics.jsonl")  # before the second launch appends to the file
    again = torchrun(4, [*saving, *small(corpus, root / "run", "train.steps=8")])
    assert again.returncode == 0, again.stderr[-3000:]
    return root, first_rows, again


def _strip(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def test_same_seed_gives_bit_identical_metrics(restarted):
    """Two launches of the same command and seed (pp2 x dp2, ZeRO-1, dropout on): the same metrics, bit for bit
    (timing fields aside), over the 4 steps they share."""
    root, first_rows, _ = restarted
    whole = read_metrics(root / "whole" / "metrics.jsonl")
    assert [r["step"] for r in first_rows] == list(range(1, 5))
    assert _strip(first_rows) == _strip(whole[:4])


def test_a_restarted_run_resumes_exactly(restarted):
    """The second launch of `run` finds checkpoint.dir's latest, resumes (data position and RNG streams
    included) and appends to the metrics: the same records as the uninterrupted run, bit for bit."""
    root, _, again = restarted
    assert "resumed from" in again.stdout and "at step 4" in again.stdout
    resumed, uninterrupted = read_metrics(root / "run" / "metrics.jsonl"), read_metrics(root / "whole" / "metrics.jsonl")
    assert len(resumed) == 8 and _strip(resumed) == _strip(uninterrupted)
    assert (root / "run" / "checkpoints" / "latest").read_text() == "step8"
