"""Runs that survive their cluster (docs/running-for-weeks.md), on real failures: a rank process SIGKILLed
under torchrun, whose agent restarts the job by itself.

Covers: a 2x2x2 run with asynchronous saves every 5 steps under ``torchrun --max-restarts=2`` loses a
random rank at a random step and finishes by itself, its per-step metrics bit-identical to an uninterrupted
run's (the restart resumes from the newest complete checkpoint); the new attempt's process group does not
read the dead attempt's keys from the agent's store (`megazero.runtime.launch.attempt_store`); two torchrun
agents as two nodes of an elastic job (``--nnodes=1:2``, c10d rendezvous), one node SIGKILLed: the other
re-forms the group at half the ranks and finishes the run (dp re-derived, the global batch and the data
order kept), or, when the layout cannot fit, every rank ends with the trainer's reason.
"""
import json
import random
import re
import time

import pytest

from megazero.resilience.link_probe import find_slow_links, ring_phases
from megazero.resilience.silent_check import first_difference, origins
from megazero.resilience.stragglers import find_stragglers
from megazero.toolbox.parity import TOLERANCES
from tests.faults import Job, bit_flip_env, slow_rank_env
from tests.harness import free_port

TIMING = {"tokens_per_s", "step_time_s", "mfu", "time_ms", "step_times"}


def _metrics(path):
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]


def _train_args(corpus, run_dir, steps):
    return ["-m", "megazero.run.train", "configs/debug_gpt.yaml", f"data.path={corpus}", f"run_dir={run_dir}",
            f"train.steps={steps}", "log.interval=1", "model.layers=4", "model.seq_len=32",
            "checkpoint.save_interval=5", "checkpoint.async_save=true", "resilience.straggler_interval=7"]


STEPS = 14


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    """The run the failure tests are compared with: 8 ranks (pp2 x tp2 x dp2), `STEPS` steps; its metrics
    without timings, and its output."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    whole = Job(["--standalone", "--nproc_per_node=8", *_train_args(corpus, folder / "run", STEPS)],
                str(folder / "run.log"))
    assert whole.wait(600) == 0, whole.output()[-3000:]
    with open(folder / "run" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows], rows, whole.output()


def test_a_killed_rank_restarts_the_job_and_resumes_exactly(corpus, tmp_path, uninterrupted):
    """One of 8 ranks (pp2 x tp2 x dp2) SIGKILLed at a random step: every rank stops, torchrun starts a new
    attempt, which resumes from the newest complete checkpoint; the finished run's metrics equal an
    uninterrupted run's, bit for bit (floats compared as written)."""
    rng = random.Random(34)
    victim, at_step, steps = rng.randrange(8), rng.randint(6, 11), STEPS
    job = Job(["--standalone", "--nproc_per_node=8", "--max-restarts=2", *_train_args(corpus, tmp_path / "run", steps)],
              str(tmp_path / "run.log"))
    metrics = str(tmp_path / "run" / "metrics.jsonl")
    seen = job.wait_for_step(metrics, at_step)
    job.kill_rank(victim)
    code = job.wait(600)
    out = job.output()
    assert code == 0, out[-4000:]
    assert "failed (exitcode: " in out, out[-3000:]  # the attempt failed (torchrun names the first exit it saw)
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", out)]
    assert len(resumed) == 1 and resumed[0] in (5, 10), out[-3000:]
    assert seen - resumed[0] <= 2 * 5  # the work lost: steps since the newest complete checkpoint
    got = _metrics(metrics)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert got == uninterrupted[0]


def _elastic_agents(tmp_path, run_dir, args, nproc=4, restarts=3):
    """Two torchrun agents on this machine as two nodes of an elastic job (``--nnodes=1:2``, c10d rendezvous
    hosted by the first)."""
    port = free_port()
    launch = ["--nnodes=1:2", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
              f"--rdzv-id={run_dir.name}", f"--max-restarts={restarts}",
              "--rdzv-conf=join_timeout=120,last_call_timeout=2,close_timeout=10,keep_alive_interval=1,"
              "keep_alive_max_attempt=3", *args]
    host = Job(launch, str(tmp_path / f"{run_dir.name}-a.log"))
    time.sleep(1.0)  # the first agent hosts the rendezvous: started first
    return host, Job(launch, str(tmp_path / f"{run_dir.name}-b.log"))


def test_elastic_job_continues_on_the_remaining_node(corpus, tmp_path, uninterrupted):
    """One agent SIGKILLed mid-run (its 4 ranks end with it): the other agent re-forms the group at 4 ranks, which
    resume from the newest complete checkpoint with pp and tp kept, dp 2 -> 1 and accumulation 4 -> 8 (the
    global batch kept), on the same samples in the same order: the losses and gradient norms of every step
    equal an uninterrupted 8-rank run's within the fp32 parity tolerance."""
    steps = STEPS
    args = _train_args(corpus, tmp_path / "run", steps)
    host, other = _elastic_agents(tmp_path, tmp_path / "run", args)
    host.wait_for_step(str(tmp_path / "run" / "metrics.jsonl"), 7)
    assert other.kill_agent() == [4, 5, 6, 7]  # its ranks follow their agent, as on a node that goes down
    assert host.wait(600) == 0, host.output()[-4000:]
    out = host.output()
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", out)]
    assert len(resumed) == 1 and resumed[0] in (5, 10), out[-3000:]
    assert "layout   pp=2 x tp=2 x dp=1 = 4 ranks" in out
    assert "batch    global 16 = micro 2 x accumulation 8 x dp 1" in out
    got, want = _metrics(tmp_path / "run" / "metrics.jsonl"), uninterrupted[0]
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    loss_rtol, norm_rtol = TOLERANCES["fp32"][:2]
    for g, w in zip(got, want, strict=True):
        assert abs(g["loss"] - w["loss"]) <= loss_rtol * abs(w["loss"]), (g, w)
        assert abs(g["grad_norm"] - w["grad_norm"]) <= norm_rtol * abs(w["grad_norm"]), (g, w)
    same = [{k: v for k, v in r.items() if k != "comm"} for r in got[:resumed[0]]]  # comm: two nodes here, one there
    assert same == [{k: v for k, v in r.items() if k != "comm"} for r in want[:resumed[0]]]  # the same 8 ranks


def test_elastic_job_refuses_clearly_when_no_layout_fits(corpus, tmp_path):
    """pp2 x tp2 on two nodes of 2 ranks: with one node lost, 2 ranks cannot hold the layout; every new attempt
    ends at once with the trainer's one-line reason and the job ends failed (no hang)."""
    args = [*_train_args(corpus, tmp_path / "small", 40), "parallel.pp=2", "parallel.tp=2"]
    host, other = _elastic_agents(tmp_path, tmp_path / "small", args, nproc=2, restarts=1)
    host.wait_for_step(str(tmp_path / "small" / "metrics.jsonl"), 2)
    other.kill_node()
    assert host.wait(600) != 0
    out = host.output()
    assert "megazero.run.train: error:" in out and "world size 2" in out, out[-3000:]


def test_find_stragglers_compares_each_rank_with_its_stage():
    """Stage 1 does twice stage 0's work: nobody is named for it; rank 5, three times its stage's peers in 7 of 8
    steps, is; a rank alone in its stage is never; one slow step in eight is noise."""
    base = [[0.1] * 8 for _ in range(4)] + [[0.2] * 8 for _ in range(4)]
    assert find_stragglers(base, [0, 0, 0, 0, 1, 1, 1, 1]) == []
    slow = [row[:] for row in base]
    slow[5] = [0.6] * 7 + [0.2]
    slow[2][3] = 0.9  # one slow step
    found = find_stragglers(slow, [0, 0, 0, 0, 1, 1, 1, 1])
    assert [(f["rank"], f["stage"], f["slow_steps"], f["steps"]) for f in found] == [(5, 1, 7, 8)]
    assert found[0]["ratio"] == 3.0 and found[0]["peers_s"] == 0.2
    assert find_stragglers([[0.1] * 4, [0.9] * 4], [0, 1]) == []


def test_ring_phases_cover_each_link_once_with_no_rank_twice_in_a_phase():
    for n in range(1, 10):
        phases = ring_phases(n)
        edges = [e for phase in phases for e in phase]
        expected = {(0, 1)} if n == 2 else {(i, (i + 1) % n) for i in range(n)} if n > 2 else set()
        assert sorted(edges) == sorted(expected) and len(edges) == len(expected), n
        assert len(phases) <= 3
        for phase in phases:
            members = [r for e in phase for r in e]
            assert len(members) == len(set(members)), (n, phase)


def test_find_slow_links_compares_each_link_with_its_axis():
    """pp links cross nodes, tp links stay inside one (10x faster): neither axis is slow for being its kind; a pp
    link 4x its peers in every round is named, one in 3 of 4 is noise; an axis's only link is never."""
    links = [{"axis": "pp", "ranks": [r, r + 4], "bytes": 2**22, "seconds": [0.004] * 4} for r in range(4)]
    links += [{"axis": "tp", "ranks": [r, r + 1], "bytes": 2**22, "seconds": [0.0004] * 4} for r in (0, 2, 4, 6)]
    assert find_slow_links(links) == []
    links[1] = {**links[1], "seconds": [0.016] * 4}
    links[2] = {**links[2], "seconds": [0.016, 0.004, 0.016, 0.016]}
    assert [(s["axis"], s["ranks"], s["ratio"], s["peers_s"], s["slow_rounds"]) for s in find_slow_links(links)] == [
        ("pp", [1, 5], 4.0, 0.004, 4)]
    assert find_slow_links([{"axis": "dp", "ranks": [0, 1], "bytes": 4, "seconds": [9.0]}]) == []


def _straggler_args(corpus, run_dir):
    return ["--standalone", "--nproc_per_node=8", "-m", "megazero.run.train", "configs/debug_gpt.yaml",
            f"data.path={corpus}", f"run_dir={run_dir}", "train.steps=8", "log.interval=4", "model.seq_len=32",
            "resilience.straggler_interval=4"]


def test_a_slow_rank_and_a_slow_link_are_named_and_nothing_healthy_is(corpus, tmp_path, uninterrupted):
    """pp2 x tp2 x dp2: global rank 6 sleeps 30 ms in each of its LayerNorms, and the pipeline link between ranks
    1 and 5 carries 200 MB/s. Within the first window of 4 steps rank 6 is named as the straggler and the link
    1<->5 as slow (in the log and the metrics), and only they, although rank 6's TP, DP and pipeline peers wait
    for it and ranks 1 and 5 are slow to each other; the same layout without either names nothing."""
    job = Job(_straggler_args(corpus, tmp_path / "slow"), str(tmp_path / "slow.log"),
              env=slow_rank_env(tmp_path / "site", 6, 0.03, link=(1, 5, 2e8)))
    assert job.wait(600) == 0, job.output()[-3000:]
    out = job.output()
    rows = [json.loads(line) for line in open(tmp_path / "slow" / "metrics.jsonl")]
    windows = [r["step_times"] for r in rows if "step_times" in r]
    assert [r["step"] for r in rows if "step_times" in r] == [4, 8]
    for found in windows:
        assert [s["rank"] for s in found["stragglers"]] == [6], found
        assert found["stragglers"][0]["ratio"] > 1.5 and found["compute_s"]["max_rank"] == 6
        assert {"tp", "pp", "dp"} <= set(found["wait_s"])  # every rank's waits, by axis
        assert [(s["axis"], s["ranks"]) for s in found["slow_links"]] == [("pp", [1, 5])], found
        assert found["slow_links"][0]["gbps"] < 0.21 and found["slow_links"][0]["ratio"] > 1.5
        assert {axis: v["count"] for axis, v in found["links"].items()} == {"pp": 4, "dp": 4, "tp": 4}
    assert "straggler: rank 6 (pipeline stage 1)" in out and "slow in 4 of 4 steps (1-4)" in out
    assert "slow link: pp ranks 1<->5: 4.0 MiB in" in out

    _, rows, out = uninterrupted  # the same layout with no slow rank or link, gathered every 7 steps
    windows = [r["step_times"] for r in rows if "step_times" in r]
    assert [(w["stragglers"], w["slow_links"]) for w in windows] == [([], []), ([], [])]
    assert "stragglers: none in steps 1-7" in out and "stragglers: none in steps 8-14" in out
    assert out.count("slow links: none (one-way time, median by axis: dp") == 2


def _flip_args(corpus, run_dir, action):
    return ["--standalone", "--nproc_per_node=8", "-m", "megazero.run.train", "configs/debug_gpt.yaml",
            f"data.path={corpus}", f"run_dir={run_dir}", "train.steps=5", "log.interval=1", "model.seq_len=32",
            "resilience.silent_error_interval=1", f"resilience.silent_error_action={action}"]


def test_a_planted_bit_flip_is_caught_and_names_its_rank(corpus, tmp_path):
    """pp2 x tp2 x dp2, every step checked: one bit of one LayerNorm output of global rank 5 (stage 1) flips once,
    at step 3. Its TP peer and the first stage's ranks receive the wrong numbers too, but only rank 5 sent or
    computed them first: it alone is named. With action skip the run goes on without that step's update; with
    stop every rank ends with the message."""
    victim, call = 5, 2 * 40 + 10  # stage 1: 5 LayerNorms per micro-batch, 4 micro-batches, 2 passes: step 3
    job = Job(_flip_args(corpus, tmp_path / "skip", "skip"), str(tmp_path / "skip.log"),
              env=bit_flip_env(tmp_path / "site", victim, call))
    assert job.wait(600) == 0, job.output()[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "skip" / "metrics.jsonl")]
    flagged = [(r["step"], r["silent_error"]["ranks"], r["skipped"]) for r in rows if "silent_error" in r]
    assert flagged == [(3, [victim], True)], rows
    assert set(rows[2]["silent_error"]["differ"]) > {victim}  # the wrong numbers reached others, who are not named
    assert "silent error at step 3: rank(s) [5]" in job.output()

    stop = Job(_flip_args(corpus, tmp_path / "stop", "stop"), str(tmp_path / "stop.log"),
               env=bit_flip_env(tmp_path / "site", victim, call))
    assert stop.wait(600) != 0
    # every rank raises it; torchrun ends the others once the first has exited, so not all may have printed it
    assert "SilentError: silent error at step 3: rank(s) [5]" in stop.output()
    assert "step 3: loss" not in stop.output()  # the wrong step was never applied nor logged


def _one_process(resilience: dict, steps: int):
    """(losses, the length of each program the executor ran, the engine) of `steps` steps of a 2-layer debug GPT
    in this process with the config's `resilience` section."""
    import megazero

    cfg = {"model": {"spec": "model_specs/gpt.py:debug", "layers": 2}, "precision": "fp32",
           "train": {"micro_batch_size": 2, "global_batch_size": 4, "seed": 1, "steps": 20},
           "optimizer": {"type": "adamw", "lr": 1e-3}, "resilience": resilience}
    engine, _, data, _ = megazero.initialize(config=cfg)
    calls, run = [], engine.executor.run
    engine.executor.run = lambda *a, **k: calls.append(len(a[0])) or run(*a, **k)
    return [engine.train_batch(data) for _ in range(steps)], calls, engine


def test_the_check_runs_twice_only_when_due_and_trains_the_same():
    """One process: a step checked every 2 steps gives the losses of an unchecked run, bit for bit; an unchecked
    engine runs its program once per step and records no fingerprint."""
    losses, runs = {}, {}
    for every in (0, 2):
        losses[every], runs[every], engine = _one_process({"silent_error_interval": every}, 4)
        assert engine.pctx.stats.fingerprints is None
    assert losses[0] == losses[2]
    full = runs[0][0]
    assert runs[0] == [full] * 4
    assert runs[2] == [full, full - 2, full - 2, 2] * 2  # a checked step: two passes, then reduce + step


def test_origins_are_where_the_first_difference_was_sent_or_computed():
    a = [("out", "tp", 1), ("in", "tp", 2), ("grad", "local", 3)]
    assert first_difference(a, a) is None
    assert first_difference(a, [("out", "tp", 9)] + a[1:]) == (0, "out")
    assert first_difference(a, a[:1] + [("in", "tp", 7), ("grad", "local", 4)]) == (1, "in")
    assert first_difference(a, a[:2]) == (2, "out")
    verdicts = [{"differs": False, "first": None}, {"differs": True, "first": "in"},
                {"differs": True, "first": "out"}, {"differs": True, "first": "in"}]
    assert origins(verdicts) == [2]
    assert origins([{"differs": True, "first": "in"}, {"differs": False, "first": None}]) == [0]  # no better guess


def test_attempt_store_skips_a_dead_attempts_post():
    """torchrun's store still holds the previous attempt's post (a port nobody listens on): rank 1 waits until
    rank 0 of this attempt posts its own store, and both end up on it."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from megazero.runtime.launch import ATTEMPT_KEY, attempt_store

    agent = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    agent.set(ATTEMPT_KEY, f"127.0.0.1:{free_port()}:deadbeef")  # the dead attempt's store
    got = {}  # the agent's store at MASTER_ADDR:MASTER_PORT
    rank1 = threading.Thread(target=lambda: got.setdefault(1, attempt_store(1, 2, "127.0.0.1", agent.port, 30,
                                                                            probe_s=0.5)))
    rank1.start()
    time.sleep(1.0)  # rank 1 has been reading the stale post meanwhile
    got[0] = attempt_store(0, 2, "127.0.0.1", agent.port, 30)
    rank1.join(30)
    got[0].set("hello", "from rank 0")
    assert got[1].get("hello") == b"from rank 0"


def test_the_ranks_left_alive_save_the_failed_step(corpus, tmp_path, uninterrupted):
    """checkpoint.save_on_failure at ZeRO-0 (every rank's state also held by its dp replica): a rank SIGKILLed
    mid-run; the others write their state at the last finished step, the next attempt makes a checkpoint of it
    and resumes there (not at the last periodic save), and the metrics still equal an uninterrupted run's."""
    job = Job(["--standalone", "--nproc_per_node=8", "--max-restarts=1",
               *_train_args(corpus, tmp_path / "run", STEPS), "checkpoint.save_on_failure=true"],
              str(tmp_path / "run.log"))
    metrics = str(tmp_path / "run" / "metrics.jsonl")
    seen = job.wait_for_step(metrics, 7)
    job.kill_rank(3)
    assert job.wait(600) == 0, job.output()[-4000:]
    out = job.output()
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", out)]
    assert "the ranks left alive by the last failure saved" in out, out[-3000:]
    assert len(resumed) == 1 and resumed[0] >= seen and resumed[0] % 5 != 0, (seen, resumed)
    assert _metrics(metrics) == uninterrupted[0]
    saved = tmp_path / "run" / "checkpoints" / f"step{resumed[0]}"
    assert sorted(p.name for p in saved.glob("rank*.safetensors")) == [f"rank{r}.safetensors" for r in range(8) if r != 3]
    assert json.loads((saved / "manifest.json").read_text())["rng"] is False  # rank 3's random states were lost


def test_promote_makes_a_checkpoint_only_of_complete_parts(tmp_path):
    """Two ranks each held half of every kind of a (4, 2) tensor (a ZeRO shard): with both parts the folder
    becomes step7 and `latest`; with one rank's part missing it stays, reported."""
    from megazero.checkpoint.failure_save import promote
    from megazero.checkpoint.sharded import FORMAT, KINDS

    meta = {"format": FORMAT, "step": 7, "layout": {"pp": 1, "tp": 1, "dp": 2, "order": ["pp", "dp", "tp"],
                                                    "zero_stage": 1}, "kinds": list(KINDS), "rng": True}

    def part(folder, rank):
        entries = [("w", [4, 2], kind, f"rank{rank}.safetensors", f"{kind}/w/0", [2 * rank, 0], [2, 2])
                   for kind in KINDS]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{rank}.json").write_text(json.dumps({"meta": meta, "entries": entries}))

    for rank in (0, 1):
        part(tmp_path / "full" / "failed7.parts", rank)
    assert promote(str(tmp_path / "full")) == str(tmp_path / "full" / "step7")
    manifest = json.loads((tmp_path / "full" / "step7" / "manifest.json").read_text())
    assert manifest["step"] == 7 and manifest["rng"] is True and len(manifest["tensors"]["w"]["exp_avg"]) == 2
    assert (tmp_path / "full" / "latest").read_text() == "step7"

    part(tmp_path / "half" / "failed7.parts", 0)
    assert promote(str(tmp_path / "half")) is None
    assert (tmp_path / "half" / "failed7.parts").is_dir() and not (tmp_path / "half" / "latest").exists()


def test_the_spike_check_reruns_only_steps_whose_loss_rose_and_trains_the_same():
    """silent_error_spike just above 1: every step (but a process's first) runs its first pass checked, the steps
    whose loss (agreed over the world) rose above the median of the last ones run the second pass too; the
    losses equal an unchecked run's bit for bit."""
    losses, runs = {}, {}
    for spike in (0.0, 1.0000001):
        losses[spike], runs[spike], _ = _one_process({"silent_error_spike": spike}, 12)
    assert losses[0.0] == losses[1.0000001]
    full = runs[0.0][0]
    steps, calls = [], runs[1.0000001][1:]  # the first step runs unchecked
    while calls:
        n = 3 if calls[1] == full - 2 else 2  # passes (, passes), reduce + step
        steps.append(n)
        calls = calls[n:]
    assert len(steps) == 11 and 2 in steps and 3 in steps  # some steps spiked, some did not
