"""Host synchronisations on the step path, counted on CPU (`megazero.runtime.sync_counter`).

On a GPU every `.item()`, `.tolist()`, `nonzero`, boolean-mask index or device-to-host copy makes the
host wait for the device. A dense 2x2x2 step may wait at most twice per step, however many
micro-batches it runs: the global gradient norm (the ranks agree on non-finite gradients through it)
and the step's loss; nothing per micro-batch. An MoE step adds one per MoE layer forward at ep 2 (its
all-to-all's split sizes), none at ep 1 and none in a recompute; its load-balance statistics are read
when the trainer writes the metrics."""
import pytest
import torch

from megazero.runtime.sync_counter import SyncCounter
from tests.harness import run_ranks


def test_counter_sees_each_kind():
    t = torch.arange(6.0)
    with SyncCounter() as syncs:
        t.tolist()
        float(t.sum())
        t[t > 2]
        torch.repeat_interleave(t.long())
        t.nonzero()
        torch.bincount(t.long())
    kinds = [k for k, _ in syncs.events]
    assert kinds == ["tolist", "item", "boolean mask index", "repeat_interleave without output_size", "nonzero",
                     "bincount"], syncs.report()
    assert all(site.startswith("tests/test_host_syncs.py:") for _, site in syncs.events), syncs.report()
    with SyncCounter() as quiet:  # none of these waits for the device
        torch.repeat_interleave(t.long(), output_size=15)
        torch.where(t > 2, t, 0.0).sum()
        t.nonzero_static(size=6)
    assert quiet.count == 0, quiet.report()
    assert torch.Tensor.tolist is not None and t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def _sites(config: str, overrides: list[str], micro_batches: int) -> list[str]:
    import megazero

    engine, _, data, _ = megazero.initialize(config=config, overrides=["data.path=null", f"train.global_batch_size="
                                                                       f"{2 * 2 * micro_batches}"] + overrides)
    engine.train_batch(data)  # the first step builds what later steps reuse (p2p shapes, buffers)
    with SyncCounter() as syncs:
        engine.train_batch(data)
    return sorted(site for _, site in syncs.events)


DENSE = [["zero.stage=1"], ["zero.stage=3", "precision=bf16", "parallel.sequence_parallel=true"],
         ["zero.stage=2", "precision=fp16", "activation_checkpointing.policy=full"],
         ["pipeline.schedule=zb-h1", "zero.stage=1", "gradient_clipping=1.0"]]


@pytest.mark.parametrize("overrides", DENSE, ids=lambda o: ",".join(o))
def test_dense_2x2x2_step_waits_only_per_step(overrides):
    """The same syncs with 2 and 4 micro-batches (none per micro-batch), at most two per step."""
    few = run_ranks(_sites, 8, "configs/debug_gpt.yaml", overrides, 2, timeout=240)
    many = run_ranks(_sites, 8, "configs/debug_gpt.yaml", overrides, 4, timeout=240)
    for rank, (a, b) in enumerate(zip(few, many, strict=True)):
        assert a == b, f"rank {rank}: syncs grow with micro-batches: {a} vs {b}"
        assert len(b) <= 2, f"rank {rank}: {b}"
        assert all(s.startswith(("megazero/zero/optimizer.py", "megazero/engine/pipeline_engine.py")) for s in b), b


def _trainer_sites(run_dir: str) -> list[str]:
    from megazero.engine import load_run_config
    from megazero.run import train

    cfg = load_run_config("configs/debug_gpt.yaml", [
        "parallel.pp=1", "parallel.tp=1", "data.path=null", "train.steps=8", "log.interval=4",
        "train.global_batch_size=4", "log.progress_bar=false", f"run_dir={run_dir}"])
    callbacks = []
    real = train.initialize_from_config

    def spy(*args, **kwargs):  # per-instruction CUDA events cost a wait per step: only when shown
        callbacks.append(kwargs.get("on_instruction"))
        return real(*args, **kwargs)

    train.initialize_from_config = spy
    with SyncCounter() as syncs:
        train.run(cfg, 0)
    assert callbacks == [None], callbacks
    return [site for _, site in syncs.events]


def test_the_trainer_reads_the_device_at_log_intervals_only(tmp_path):
    """8 steps logged every 4: the trainer reads the losses and norms twice (one stack each); the rest
    is the optimizer's one read per step (the non-finite check every precision makes)."""
    (sites,) = run_ranks(_trainer_sites, 1, str(tmp_path / "run"), timeout=240)
    trainer = [s for s in sites if not s.startswith("megazero/zero/optimizer.py")]
    assert len(trainer) == 2 and all(s.startswith("megazero/run/metrics.py") for s in trainer), sites
    assert len(sites) - len(trainer) == 8, sites


# MoE, configs/debug_moe.yaml on 8 ranks: pp 2 x dp 2 x tp 2 (experts' ffn split over TP), ep 2 (or 1)
MOE = [["parallel.tp=2"],
       ["parallel.tp=2", "activation_checkpointing.policy=full", "model.moe.capacity_factor=1.25"],
       ["parallel.tp=2", "parallel.ep=1", "model.moe.capacity_factor=1.25"],
       ["parallel.tp=2", "parallel.ep=1", "activation_checkpointing.policy=full"]]
SPLITS = "megazero/moe/dispatch.py"  # plan_dispatch's one .tolist() of the all-to-all's split sizes


@pytest.mark.parametrize("overrides", MOE, ids=lambda o: ",".join(o))
def test_moe_step_waits_once_per_layer_forward_at_ep2_and_never_at_ep1(overrides):
    """With ep 2 an MoE layer's forward waits once, for its all-to-all's split sizes (the host must
    pass them to the collective), and nowhere else: not in routing, dispatch, the experts (grouped
    GEMMs), the recompute (which replays the forward's plan) or the step's MoE statistics. With ep 1
    it never waits. The rest is the dense step's: the same with 2 and 4 micro-batches, at most two."""
    from megazero.core.config import load_config

    ep = 1 if "parallel.ep=1" in overrides else 2
    layers = load_config("configs/debug_moe.yaml").model.layers // 2  # MoE blocks per pipeline stage
    for micro in (2, 4):
        for rank, sites in enumerate(run_ranks(_sites, 8, "configs/debug_moe.yaml", overrides, micro, timeout=240)):
            moe = [s for s in sites if s.startswith("megazero/moe/")]
            dense = [s for s in sites if not s.startswith("megazero/moe/")]
            assert len(moe) == (layers * micro if ep == 2 else 0), f"rank {rank}, {micro} micro-batches: {sites}"
            assert all(s.startswith(SPLITS) for s in moe), sites
            assert len(dense) <= 2 and all(s.startswith(("megazero/zero/optimizer.py",
                                                         "megazero/engine/pipeline_engine.py")) for s in dense), sites


def _moe_trainer_events(run_dir: str) -> list[str]:
    from megazero.engine import load_run_config
    from megazero.run import train

    cfg = load_run_config("configs/debug_moe.yaml", [
        "parallel.pp=1", "parallel.ep=1", "data.path=null", "train.steps=8", "log.interval=4",
        "train.global_batch_size=2", "log.progress_bar=false", f"run_dir={run_dir}"])
    with SyncCounter() as syncs:
        train.run(cfg, 0)
    return [site.split(":")[0] for _, site in syncs.events if not site.startswith("megazero/zero/optimizer.py")]


def test_the_trainer_reads_the_moe_statistics_when_it_writes_the_metrics(tmp_path):
    """The MoE statistics of each step stay on the device until the trainer writes the step's record
    (`MoEStepStats`, read once as it is serialised), after the losses' one read at the log interval:
    every read of the trainer's is at a flush, none in the steps between."""
    import json

    (sites,) = run_ranks(_moe_trainer_events, 1, str(tmp_path / "run"), timeout=240)
    flush, stats = "megazero/run/metrics.py", "megazero/moe/stats.py"
    assert sites == 2 * ([flush] + 4 * [stats]), sites
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(rows) == 8 and all(len(r["moe"]["tokens_per_expert"]) == 8 and r["moe"]["imbalance"] >= 1
                                  for r in rows)
