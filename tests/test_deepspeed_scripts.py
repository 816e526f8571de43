"""DeepSpeed users' scripts, changed only in their import (``import megazero as deepspeed``), train
like plain PyTorch on the same global batches: per-step losses and the final logits within 1e-5
relative, at ZeRO 0, 1, 2, 3 and ZeRO-2 with optimizer offload, with weight decay and clipping on,
on 2 ranks (dp = 2).

- tests/deepspeed_scripts/classifier.py (DeepSpeed's CIFAR tutorial shape: argparse config arguments,
  a DeepSpeed JSON file, `model_engine(inputs)`, backward, step): weight decay on every parameter (the
  user's AdamW semantics), clipping at 0.05; it saves after 3 steps and a new engine loads the
  checkpoint and trains 3 more (all 6 steps compared with the uninterrupted PyTorch run).
- tests/deepspeed_scripts/hf_causal_lm.py (a Hugging Face loop): the no_decay parameter groups, a
  client AdamW and LambdaLR, a dict config without gradient_clipping (DeepSpeed's default 1.0
  applies), `training_data` + `collate_fn` (DeepSpeed's shuffled DistributedSampler).
- tests/deepspeed_scripts/pipeline_mlp.py (DeepSpeed's pipeline tutorial shape): a PipelineModule of
  plain layers with no stage argument, `train_batch()` on the training data's (inputs, labels) at
  pp=2 x dp=2 (DeepSpeed itself refuses ZeRO-2/3 with a pipeline; megazero runs them), one case with
  activation_checkpoint_interval=1.
"""
import json

import pytest
import torch

from tests.harness import run_ranks

DP, MICRO, GAS = 2, 2, 2
CASES = {"zero0": {"stage": 0}, "zero1": {"stage": 1}, "zero2": {"stage": 2}, "zero3": {"stage": 3},
         "zero2-offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
TOL = 1e-5


def ds_config(zero, **extra):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "zero_optimization": zero,
            **extra}


def _close(got, want, what):
    got, want = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= TOL, (what, err)
    return err


# -- (a) the classifier ------------------------------------------------------------------------------

CLASSIFIER = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}, "gradient_clipping": 0.05}


def classifier_worker(paths, ckpt_root):
    from tests.deepspeed_scripts import classifier

    out = {}
    for name, path in paths.items():  # 3 steps, save; a new engine loads the checkpoint and trains 3 more
        first = classifier.main(["--deepspeed_config", path, "--steps", "3", "--save_dir", f"{ckpt_root}/{name}"])
        second = classifier.main(["--deepspeed_config", path, "--steps", "6", "--load_dir", f"{ckpt_root}/{name}"])
        out[name] = dict(second, losses=first["losses"] + second["losses"])
    return out


def classifier_reference(steps=6):
    from tests.deepspeed_scripts import classifier

    torch.manual_seed(0)
    net = classifier.Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x, y = classifier.global_batch(step, MICRO * GAS * DP)
        opt.zero_grad()
        total = 0.0
        for xb, yb in zip(x.split(MICRO), y.split(MICRO), strict=True):  # rank r's micro-batches are rows [r·gas·micro, ...)
            loss = torch.nn.functional.cross_entropy(net(xb), yb) / (GAS * DP)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        opt.step()
        losses.append(total)
    with torch.no_grad():
        return losses, net.eval()(classifier.EVAL_INPUTS).tolist()


def test_a_deepspeed_classifier_script_trains_like_pytorch(tmp_path):
    paths = {}
    for name, zero in CASES.items():
        paths[name] = str(tmp_path / f"{name}.json")
        with open(paths[name], "w") as f:
            json.dump(ds_config(zero, **CLASSIFIER), f)
    results = run_ranks(classifier_worker, DP, paths, str(tmp_path / "ckpt"), timeout=300)[0]
    losses, logits = classifier_reference()
    for name, got in results.items():
        loss_err = _close(got["losses"], losses, (name, "losses"))
        logit_err = _close(got["logits"], logits, (name, "logits"))
        print(f"classifier {name}: losses {loss_err:.1e}, logits {logit_err:.1e} relative")
        assert got["grad_norm"] is not None and got["grad_norm"] > 0.05  # clipping was active


# -- (b) the Hugging Face loop -------------------------------------------------------------------------

def hf_worker(configs):
    from tests.deepspeed_scripts import hf_causal_lm

    return {name: hf_causal_lm.main(cfg) for name, cfg in configs.items()}


def hf_reference(steps=6):
    import torch.utils.data as tud

    from tests.deepspeed_scripts import hf_causal_lm as script

    model = script.build_model()
    opt = torch.optim.AdamW(script.param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, script.warmup)
    data = script.dataset()
    per_rank = [list(tud.DataLoader(data, batch_size=MICRO, collate_fn=script.collate,
                                    sampler=tud.DistributedSampler(data, num_replicas=DP, rank=r))) for r in range(DP)]
    losses = []
    for step in range(steps):
        total = 0.0
        for r in range(DP):
            for j in range(GAS):
                loss = model(**per_rank[r][step * GAS + j]).loss / (GAS * DP)
                loss.backward()
                total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed's default
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=data[0]["input_ids"][None]).logits
    return losses, logits[0, :4].tolist(), sched.get_last_lr()


def test_b_hugging_face_deepspeed_loop_trains_like_pytorch():
    pytest.importorskip("transformers")
    results = run_ranks(hf_worker, DP, {name: ds_config(zero) for name, zero in CASES.items()}, timeout=300)[0]
    losses, logits, lrs = hf_reference()
    for name, got in results.items():
        loss_err = _close(got["losses"], losses, (name, "losses"))
        logit_err = _close(got["logits"], logits, (name, "logits"))
        print(f"hf {name}: losses {loss_err:.1e}, logits {logit_err:.1e} relative")
        assert got["lr"] == pytest.approx(lrs)  # the client LambdaLR stepped once per optimizer step


# -- (c) the pipeline ---------------------------------------------------------------------------------

PIPE_CASES = {**CASES, "zero1-checkpointed": {"stage": 1, "interval": 1}}


def pipeline_worker(configs):
    from tests.deepspeed_scripts import pipeline_mlp

    return {name: pipeline_mlp.main(cfg, activation_checkpoint_interval=interval)
            for name, (cfg, interval) in configs.items()}


def pipeline_reference(steps=6):
    import torch.utils.data as tud

    from tests.deepspeed_scripts import pipeline_mlp as script

    model = torch.nn.Sequential(*script.layers())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = script.dataset()
    per_rank = [list(tud.DataLoader(data, batch_size=MICRO, sampler=tud.DistributedSampler(data, num_replicas=DP, rank=r)))
                for r in range(DP)]
    losses = []
    for step in range(steps):
        total = 0.0
        for r in range(DP):
            for j in range(GAS):
                x, y = per_rank[r][step * GAS + j]
                loss = torch.nn.functional.cross_entropy(model(x), y) / (GAS * DP)
                loss.backward()
                total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed's default
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def test_c_deepspeed_pipeline_script_trains_like_pytorch():
    configs = {}
    for name, zero in PIPE_CASES.items():
        zero = dict(zero)
        interval = zero.pop("interval", 0)
        configs[name] = (ds_config(zero, optimizer={"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
                                   pipeline={"stages": "auto", "partition": "uniform"}), interval)
    ranks = run_ranks(pipeline_worker, 2 * DP, configs, timeout=300)
    want = pipeline_reference()
    for name in configs:
        got = ranks[0][name]
        err = _close(got["losses"], want, (name, "losses"))
        print(f"pipeline {name}: losses {err:.1e} relative")
        assert [r[name]["first"] for r in ranks] == [True, True, False, False]  # stage = rank // dp
        assert all(r[name]["losses"] == got["losses"] for r in ranks)  # every stage reports the same loss
