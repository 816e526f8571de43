"""Host synchronisations on the step path, counted on CPU (`megazero.runtime.sync_counter`).

On a GPU every `.item()`, `.tolist()`, `nonzero`, boolean-mask index or device-to-host copy makes the
host wait for the device. A dense 2x2x2 step may wait at most twice per step, however many
micro-batches it runs: the global gradient norm (the ranks agree on non-finite gradients through it)
and the step's loss; nothing per micro-batch."""
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
    for rank, (a, b) in enumerate(zip(few, many)):
        assert a == b, f"rank {rank}: syncs grow with micro-batches: {a} vs {b}"
        assert len(b) <= 2, f"rank {rank}: {b}"
        assert all(s.startswith(("megazero/zero/optimizer.py", "megazero/engine/pipeline_engine.py")) for s in b), b


def _trainer_sites(run_dir: str) -> list[str]:
    from megazero.engine import load_run_config
    from megazero.run import train

    cfg = load_run_config("configs/debug_gpt.yaml", [
        "parallel.pp=1", "parallel.tp=1", "data.path=null", "train.steps=8", "log.interval=4",
        "train.global_batch_size=4", "log.progress_bar=false", f"run_dir={run_dir}"])
    with SyncCounter() as syncs:
        train.run(cfg, 0)
    return [site for _, site in syncs.events]


def test_the_trainer_reads_the_device_at_log_intervals_only(tmp_path):
    """8 steps logged every 4: the trainer reads the losses and norms twice (one stack each); the rest
    is the optimizer's one read per step (the non-finite check every precision makes)."""
    (sites,) = run_ranks(_trainer_sites, 1, str(tmp_path / "run"), timeout=240)
    trainer = [s for s in sites if not s.startswith("megazero/zero/optimizer.py")]
    assert len(trainer) == 2 and all(s.startswith("megazero/run/metrics.py") for s in trainer), sites
    assert len(sites) - len(trainer) == 8, sites
