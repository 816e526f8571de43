"""A NaN in one rank's gradient, in bf16 at pp=2 x dp=2: every rank sees it (the flag is all-reduced
over the world group) and does what ``nonfinite_gradients`` says: skip the step on every rank and
count it, leaving the parameters as they were, or stop every rank with an error naming the step and,
on the rank that holds it, the parameter."""
import pytest
import torch

from tests.harness import RankError, run_ranks

CONFIG = {"model": {"spec": "model_specs/gpt.py:debug", "layers": 2, "hidden": 32, "heads": 4, "vocab": 64,
                    "seq_len": 16},
          "precision": "bf16", "parallel": {"pp": 2, "tp": 1}, "zero": {"stage": 1},
          "train": {"micro_batch_size": 2, "global_batch_size": 8, "seed": 1},
          "optimizer": {"type": "adamw", "lr": 1e-3}}
POISONED = "layers.0.mlp.fc1.weight"  # on stage 0; rank 0 poisons it at step 2


def nan_worker(mode: str):
    import torch.distributed as dist

    import megazero

    engine, optimizer, data, _ = megazero.initialize(config=dict(CONFIG, nonfinite_gradients=mode))
    rank = dist.get_rank()
    params = {p.logical_name: p for p in engine.module.parameters()}
    report = []
    for step in (1, 2, 3):
        handle = None
        if step == 2 and rank == 0:
            handle = params[POISONED].register_hook(lambda g: g * float("nan"))
        with optimizer.full_parameters():
            before = {k: p.detach().float().clone() for k, p in params.items()}
        loss = engine.train_batch(data)
        with optimizer.full_parameters():
            unchanged = all(torch.equal(before[k], p.detach().float()) for k, p in params.items())
        if handle is not None:
            handle.remove()
        info = engine.last_info
        report.append((step, info["skipped"], info["skipped_steps"], unchanged, loss == loss))
    return report


def test_a_nan_on_one_rank_skips_the_step_on_every_rank():
    for rank, report in enumerate(run_ranks(nan_worker, 4, "skip", timeout=120)):
        assert report == [(1, False, 0, False, True), (2, True, 1, True, True), (3, False, 1, False, True)], rank


def test_a_nan_on_one_rank_stops_every_rank_when_asked():
    with pytest.raises(RankError) as err:
        run_ranks(nan_worker, 4, "error", timeout=120)
    msg = str(err.value)
    assert f"NonFiniteGradients: step 2: non-finite gradients (first on this rank: {POISONED})" in msg, msg
    for rank in range(4):  # every rank stops at the step, none waits for a timeout
        stage = rank // 2
        assert (f"stage {stage} (rank {rank}) waiting at OptimizerStep (instruction 12 of 12): "
                f"NonFiniteGradients: step 2") in msg, msg


def test_ignore_is_refused_with_a_dynamic_fp16_loss_scale():
    """`ignore` (no check, no host synchronisation in the step) cannot drive a dynamic loss scale,
    which backs off on overflow; the error names the key, before any process group exists."""
    from megazero.core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="nonfinite_gradients: 'ignore' cannot go with fp16's dynamic loss scale"):
        load_config(dict(CONFIG, precision="fp16", nonfinite_gradients="ignore", parallel={"pp": 1}))
    cfg = load_config(dict(CONFIG, precision="fp16", nonfinite_gradients="ignore", fp16={"loss_scale": 128}))
    assert cfg.nonfinite_gradients == "ignore"
