"""Sharded checkpoints (megazero/run/checkpoint.py) through the engine API, as a user's script uses it:
`engine.save_checkpoint(dir)`, new processes, `engine.load_checkpoint(dir)` (its `latest`), and the
data from the loaded step (`megazero.engine.data_iterator`).

- Exact resume: 2N steps (N = 5) in one go and N + save + new processes + load + N give bit-identical
  per-step losses and gradient norms at pp2 x tp2 x dp2 with ZeRO-1 and ZeRO-3, dropout 0.1 (the RNG
  streams are restored), and in bf16.
- Resharding: saved at pp2 x tp2 x dp2 with ZeRO-1, loaded at pp1 x tp4 x dp2 (ZeRO-2), pp4 x tp1 x dp2
  (ZeRO-3), one process (ZeRO-0), and pp2 x tp2 x dp2 with another axis order; the next steps equal
  the uninterrupted run within 1e-5 relative (master weights, Adam moments, step count, LR schedule).
- The files: one per rank plus a manifest; nothing is left in <tag>.tmp; `latest` names the tag.
- A model that does not match the checkpoint gets one error naming the tensor, on every rank.
"""
import json
import os

import pytest

from tests.harness import RankError, run_ranks

BASE = {"model": {"spec": "model_specs/gpt.py:debug", "layers": 4},
        "train": {"micro_batch_size": 2, "global_batch_size": 8, "seed": 5, "steps": 20},
        "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.1}, "gradient_clipping": 1.0,
        "scheduler": {"type": "WarmupLR", "warmup_steps": 4},
        "zero": {"reduce_bucket_size": 5000, "param_persistence_threshold": 0}}


def config(pp=2, tp=2, stage=1, order=None, **extra):
    parallel = {"pp": pp, "tp": tp, **({"order": order} if order else {})}
    return dict(BASE, parallel=parallel, zero=dict(BASE["zero"], stage=stage), **extra)


def train(cfg, steps, save_dir=None, load_dir=None):
    """(losses, grad norms) of `steps` steps, after loading `load_dir` if given, saving to `save_dir` after."""
    import megazero
    from megazero.engine import data_iterator, load_run_config

    engine, optimizer, data, _ = megazero.initialize(config=cfg)
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
        data = data_iterator(load_run_config(cfg), engine, engine.global_steps)
    losses, norms = [], []
    for _ in range(steps):
        losses.append(engine.train_batch(data))
        norms.append(engine.last_info["grad_norm"])
    if save_dir is not None:
        engine.save_checkpoint(save_dir, client_state={"note": "hi"})
    return losses, norms


@pytest.mark.parametrize("name, cfg", [
    ("zero1-dropout", config(stage=1, model=dict(BASE["model"], dropout=0.1))),
    ("zero3-dropout", config(stage=3, model=dict(BASE["model"], dropout=0.1))),
    ("zero1-bf16", config(stage=1, precision="bf16")),
])
def test_resume_is_bit_identical(name, cfg, tmp_path):
    n = 5  # 10 + 10 steps measured once for the closing note; 5 + 5 keep the suite's budget
    whole = run_ranks(train, 8, cfg, 2 * n, timeout=300)[0]
    first = run_ranks(train, 8, cfg, n, str(tmp_path), timeout=300)[0]
    second = run_ranks(train, 8, cfg, n, None, str(tmp_path), timeout=300)[0]
    assert first[0] + second[0] == whole[0]
    assert first[1] + second[1] == whole[1]
    assert (tmp_path / "latest").read_text() == f"step{n}"
    files = sorted(os.listdir(tmp_path / f"step{n}"))
    assert files == ["manifest.json"] + sorted(f"rank{r}.safetensors" for r in range(8))
    manifest = json.loads((tmp_path / f"step{n}" / "manifest.json").read_text())
    assert manifest["step"] == n and manifest["client_state"] == {"note": "hi"}
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


STEPS = 5


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The uninterrupted 2x2x2 ZeRO-1 run of 2 x STEPS steps, and a checkpoint after STEPS."""
    path = tmp_path_factory.mktemp("ckpt")
    whole = run_ranks(train, 8, config(), 2 * STEPS, timeout=300)[0]
    run_ranks(train, 8, config(), STEPS, str(path), timeout=300)
    return str(path), whole


@pytest.mark.parametrize("pp, tp, dp, stage, order", [
    (1, 4, 2, 2, None), (4, 1, 2, 3, None), (1, 1, 1, 0, None), (2, 2, 2, 1, ["dp", "tp", "pp"])])
def test_another_layout_continues_the_run(saved, pp, tp, dp, stage, order):
    path, whole = saved
    losses, norms = run_ranks(train, pp * tp * dp, config(pp, tp, stage, order), STEPS, None, path, timeout=300)[0]
    for got, want in ((losses, whole[0][STEPS:]), (norms, whole[1][STEPS:])):
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        assert worst <= 1e-5, (worst, got, want)


def test_another_model_is_refused_on_every_rank(saved):
    path, _ = saved
    with pytest.raises(RankError) as err:
        run_ranks(train, 2, config(1, 1, 1, model={"spec": "model_specs/llama.py:debug", "layers": 4}), 1, None, path,
                  timeout=120)
    text = str(err.value)
    assert "manifest.json" in text and "saved from another model" in text
    assert "failed on 2 rank(s)" in text  # agreed: both ranks raise the same error
