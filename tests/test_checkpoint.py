"""Sharded checkpoints (megazero/run/checkpoint.py) through the engine API, as a user's script uses it:
`engine.save_checkpoint(dir)`, new processes, `engine.load_checkpoint(dir)` (its `latest`), and the
data from the loaded step (`megazero.engine.data_iterator`).

- Exact resume: 2N steps (N = 5) in one go and N + save + new processes + load + N give bit-identical
  per-step losses and gradient norms at pp2 x tp2 x dp2 with ZeRO-1 in bf16 and ZeRO-3 in fp32, both
  with dropout 0.1 (the RNG streams are restored).
- Resharding: saved at pp2 x tp2 x dp2 with ZeRO-1, loaded at pp1 x tp4 x dp2 (ZeRO-2), pp4 x tp1 x dp2
  (ZeRO-3), one process (ZeRO-0), and pp2 x tp2 x dp2 with another axis order; the next steps equal
  the uninterrupted run within 1e-5 relative (master weights, Adam moments, step count, LR schedule).
- The files: one per rank plus a manifest; nothing is left in <tag>.tmp; `latest` names the tag.
- A model that does not match the checkpoint gets one error naming the tensor, on every rank; a
  truncated, corrupted (header) or deleted shard gets one naming the file, on every rank.
- A rank SIGKILLed in the middle of a save leaves the previous checkpoint loadable and `latest` naming
  it; keep_last deletes only complete checkpoints older than the newest ones.
- ModuleEngine (a plain nn.Module) saves at ZeRO-2 x dp2 and continues on one rank.
- tools/checkpoint_info.py prints the layout, step, files and tensors.
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
    ("zero1-bf16-dropout", config(stage=1, precision="bf16", model=dict(BASE["model"], dropout=0.1))),
    ("zero3-dropout", config(stage=3, model=dict(BASE["model"], dropout=0.1))),
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


def _copy(path, tmp_path):
    import shutil

    dst = tmp_path / "ckpt"
    shutil.copytree(path, dst)
    return dst, dst / (dst / "latest").read_text()


@pytest.mark.parametrize("damage", ["truncate", "corrupt-header", "delete"])
def test_a_damaged_shard_is_named_on_every_rank(saved, tmp_path, damage):
    root, tag = _copy(saved[0], tmp_path)
    victim = tag / "rank3.safetensors"
    if damage == "truncate":
        data = victim.read_bytes()
        victim.write_bytes(data[:len(data) // 2])
    elif damage == "corrupt-header":
        data = bytearray(victim.read_bytes())
        data[8:40] = b"\xff" * 32
        victim.write_bytes(bytes(data))
    else:
        victim.unlink()
    with pytest.raises(RankError) as err:
        run_ranks(train, 2, config(1, 1, 1), 1, None, str(root), timeout=120)
    text = str(err.value)
    assert "rank3.safetensors" in text and "failed on 2 rank(s)" in text, text


def save_then_die(cfg, path, kill_rank):
    """3 steps with a save after 2; during the second save rank `kill_rank` writes half a file and
    is SIGKILLed."""
    import signal

    import megazero
    import torch.distributed as dist
    from megazero.run import safetensors_io

    engine, _, data, _ = megazero.initialize(config=cfg)
    for step in range(3):
        engine.train_batch(data)
        if step == 1:
            engine.save_checkpoint(path)
    if dist.get_rank() == kill_rank:
        def dying(path, layout, tensors, metadata=None):
            with open(path, "wb") as f:
                f.write(b"partial")
            os.kill(os.getpid(), signal.SIGKILL)
        safetensors_io.write = dying
    engine.save_checkpoint(path)


def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    cfg = config(2, 1, 1)
    with pytest.raises(RankError, match="died"):
        run_ranks(save_then_die, 4, cfg, str(tmp_path), 1, timeout=120)
    assert (tmp_path / "latest").read_text() == "step2"
    assert not (tmp_path / "step3").exists() and (tmp_path / "step3.tmp").exists()
    losses, _ = run_ranks(train, 4, cfg, 1, None, str(tmp_path), timeout=120)[0]  # the previous one loads
    assert len(losses) == 1


def test_checkpoint_info_prints_the_manifest(saved):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "tools/checkpoint_info.py", saved[0], "--tensors"], capture_output=True,
                       text=True, cwd=root, timeout=60)
    assert p.returncode == 0, p.stderr
    assert f"step {STEPS}" in p.stdout and "pp=2 x tp=2 x dp=2, order pp,dp,tp, ZeRO-1" in p.stdout
    assert "8 rank files" in p.stdout and "embedding.word.weight" in p.stdout


def test_keep_last_deletes_only_older_complete_checkpoints(tmp_path):
    from megazero.run.checkpoint import _prune

    for step in (2, 4, 6, 8):
        (tmp_path / f"step{step}").mkdir()
        (tmp_path / f"step{step}" / "manifest.json").write_text(json.dumps({"step": step}))
    (tmp_path / "step10.tmp").mkdir()  # an unfinished save is never counted or deleted here
    _prune(str(tmp_path), 2)
    assert sorted(os.listdir(tmp_path)) == ["step10.tmp", "step6", "step8"]


def module_worker(stage, steps, save_dir=None, load_dir=None, start=0):
    """A plain nn.Module under ModuleEngine (DeepSpeed's engine(batch) / backward / step): `steps`
    global steps of 8 samples (dp ranks take their slices) from global step `start`; its parameters."""
    import torch

    import megazero

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    cfg = {"zero": {"stage": stage, "reduce_bucket_size": 64}, "optimizer": {"type": "adamw", "lr": 1e-2},
           "train": {"micro_batch_size": 2, "global_batch_size": 8}}
    engine, _, _, _ = megazero.initialize(model=model, config=cfg)
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
    dp, r = engine.pctx.dp_size, engine.pctx.dp_rank
    for step in range(start, start + steps):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
        mine = x[r * 8 // dp:(r + 1) * 8 // dp]
        for mb in mine.split(2):
            loss = (engine(mb) ** 2).mean()
            engine.backward(loss)
            engine.step()
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    return [p.detach().clone() for p in engine.module.parameters()]


def test_module_engine_checkpoint_reshards(tmp_path):
    whole = run_ranks(module_worker, 2, 2, 6, timeout=120)[0]
    run_ranks(module_worker, 2, 2, 3, str(tmp_path), timeout=120)
    resumed = run_ranks(module_worker, 1, 0, 3, None, str(tmp_path), 3, timeout=120)[0]  # ZeRO-2 x dp2 -> one rank
    assert max((a - b).abs().max().item() for a, b in zip(resumed, whole)) <= 1e-6
