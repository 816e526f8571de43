"""The dry run (megazero/toolbox/dry_run.py): one step of a layout on the meta device under a recording process
group. Its per-rank peak agrees with what a real run measures, and what NCCL would reject is reported with
the rank, the group and the call site."""
import pytest
import torch

from megazero.toolbox.dry_run import dry_run, format_report
from tests.harness import run_ranks

DEBUG = "configs/debug_llama.yaml"  # pp 2 x tp 2, here with dp 2: 8 ranks


def _real_memory(config, overrides):
    """memory_report of one real step on this rank: model states, buffers, activations at their peak."""
    import megazero
    from megazero.run.memory import SavedActivationMeter, memory_report

    engine, optimizer, data, _ = megazero.initialize(config=config, overrides=list(overrides))
    checkpointer = engine.module.activation_checkpointer
    meter = SavedActivationMeter(engine.module, checkpointer=checkpointer)
    with meter.measure():
        engine.train_batch(data)
    return memory_report(optimizer, meter, checkpointer)


@pytest.mark.parametrize("overrides", [["zero.stage=1"], ["zero.stage=3"]], ids=["zero1", "zero3"])
def test_peak_of_the_debug_layout_within_10_percent_of_the_real_run(overrides):
    overrides = ["data.path=null", "parallel.dp=2"] + overrides
    out = dry_run(DEBUG, overrides, world_size=8)
    assert out["problems"] == [], format_report(out)
    real = run_ranks(_real_memory, 8, DEBUG, overrides, timeout=180)
    for rank, info in out["per_rank"].items():
        measured = sum(real[rank].values())
        assert abs(info["peak_bytes"] - measured) <= 0.10 * measured, (rank, info["peak_bytes"], real[rank])
        assert info["report"]["live_before_step"] == sum(real[rank][k] for k in ("params", "grads", "master",
                                                                                "optimizer_states", "comm_buffers"))
        assert info["peak_live_bytes"] >= info["peak_bytes"] * 0.95  # temporaries come on top


def test_a_cpu_tensor_in_a_collective_is_reported_with_rank_group_and_site(monkeypatch):
    """A planted bug: the gradient norm's accumulator made on the CPU (as code written for a CPU run
    would), then all-reduced: NCCL would refuse it. The dry run names every rank, the group and the line."""
    from megazero.zero.optimizer import ZeroOptimizer

    real = ZeroOptimizer._squared_norm

    def on_cpu(self):
        device, self.device = self.device, torch.device("cpu")
        try:
            return real(self)
        finally:
            self.device = device
    monkeypatch.setattr(ZeroOptimizer, "_squared_norm", on_cpu)
    out = dry_run(DEBUG, ["data.path=null", "parallel.dp=2", "train.global_batch_size=4"], world_size=8)
    cpu = [p for p in out["problems"] if "cpu tensor" in p]
    assert len(cpu) == len(out["ranks"]), out["problems"]
    assert cpu[0].startswith("rank 0: all_reduce on group world (ranks [0, 1, 2, 3, 4, 5, 6, 7]) got a cpu tensor "
                             "torch.float64 (1,) at megazero/zero/optimizer.py:"), cpu[0]
    assert "in _squared_norm" in cpu[0]
    assert "problem(s)" in format_report(out)


def test_diverging_members_and_unmatched_sends_are_named():
    from megazero.toolbox.dry_run import Recorder, compare_collectives, compare_p2p

    a, b = Recorder(0), Recorder(1)
    for rec, buckets in ((a, (0, 1, 2)), (b, (0, 2))):  # rank 1 skips bucket 1
        for i in buckets:
            rec.collectives[(0, 1)].append(("reduce_scatter", f"torch.float32 x8 sum [bucket {i}]", "on dp at x.py:1"))
    a.p2p_ops[(0, 1)].append(("send", "torch.float32 (2, 3)", "on pp at p2p.py:1"))
    b.p2p_ops[(0, 1)].append(("recv", "torch.float32 (3, 2)", "on pp at p2p.py:2"))
    (problem,) = compare_collectives({0: a, 1: b})
    assert problem.startswith("group [0, 1] diverges at operation #1:") and "[bucket 1]" in problem and "[bucket 2]" in problem
    (problem,) = compare_p2p({0: a, 1: b})
    assert "p2p 0 -> 1 diverges at operation #0" in problem and "(2, 3)" in problem and "(3, 2)" in problem
