"""The DeepSpeed surface in one process: client optimizers taken over (and refused), the ZeRO optimizer
as a torch.optim.Optimizer driven by its parameter groups and torch's schedulers, initialize's
arguments, the engine accessors and no_sync, the import paths. Multi-rank parity of whole scripts is
in tests/test_deepspeed_scripts.py."""
import argparse

import pytest
import torch

import megazero
from megazero.core.config import ConfigError
from megazero.engine.factories import take_over

CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0}


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("make, kind", [
    (lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.1), "adam"),
    (lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.1, decoupled_weight_decay=True), "adamw"),
    (lambda p: torch.optim.AdamW(p, lr=1e-3), "adamw"),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "sgd"),
    (lambda p: megazero.ops.adam.FusedAdam(p, adam_w_mode=False), "adam"),
    (lambda p: megazero.ops.adam.DeepSpeedCPUAdam(p), "adamw"),
])
def test_client_optimizers_are_taken_over_with_their_groups(make, kind):
    params = list(model().parameters())
    client = make(params)
    spec, groups = take_over(client, params)
    assert spec.type == kind and groups is client.param_groups
    spec2, _ = take_over(make, params)  # a callable building one from the parameters
    assert spec2.type == kind


@pytest.mark.parametrize("make, match", [
    (lambda p: torch.optim.AdamW(p, amsgrad=True), "amsgrad=True"),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), "nesterov=True"),
    (lambda p: torch.optim.SGD(p, lr=0.1, dampening=0.5), "dampening"),
    (lambda p: torch.optim.RMSprop(p), "RMSprop.*Adam, AdamW"),
    (lambda p: torch.optim.AdamW([{"params": p[:2], "amsgrad": True}, {"params": p[2:]}]), "amsgrad"),
])
def test_what_the_zero_optimizer_cannot_run_is_refused_by_name(make, match):
    params = list(model().parameters())
    with pytest.raises(ConfigError, match=match):
        take_over(make(params), params)


def test_parameter_groups_drive_each_step_like_torch():
    """Two groups with their own lr and weight decay, a torch LambdaLR on the returned optimizer, and
    an lr edited by hand: 3 steps equal torch.optim.AdamW's on the same groups."""
    ref, net = model(), model()
    groups = lambda m: [{"params": [m[0].weight, m[2].weight], "weight_decay": 0.1},  # noqa: E731
                        {"params": [m[0].bias, m[1].weight, m[1].bias, m[2].bias], "weight_decay": 0.0, "lr": 3e-3}]
    torch_opt = torch.optim.AdamW(groups(ref), lr=1e-2)
    torch_sched = torch.optim.lr_scheduler.LambdaLR(torch_opt, lambda s: 1.0 / (s + 1))
    engine, opt, _, _ = megazero.initialize(model=net, model_parameters=groups(net),
                                            config={**CFG, "gradient_accumulation_steps": 1,
                                                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    for step in range(3):
        for m, o, s, backward in ((ref, torch_opt, torch_sched, lambda l: l.backward()),
                                  (net, opt, sched, engine.backward)):
            if step == 2:
                o.param_groups[1]["lr"] = 5e-4  # by hand, as some scripts do
            backward(m(x).pow(2).mean())
            (engine.step if m is net else o.step)()
            if m is ref:
                o.zero_grad()
            s.step()
    assert engine.get_lr() == pytest.approx([g["lr"] for g in torch_opt.param_groups])
    for a, b in zip(ref.parameters(), net.parameters(), strict=True):
        # fp32 parameters after the same updates from another implementation (the same math, another order): ~8 ulps; atol for near-0 entries
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(NotImplementedError, match="flattened"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})


def test_initialize_takes_deepspeeds_arguments_and_refuses_what_it_cannot_use(tmp_path):
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CFG))
    args = megazero.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepspeed_config", str(path)])
    engine, *_ = megazero.initialize(args=args, model=model())
    assert engine.gradient_accumulation_steps() == 2 and engine.train_micro_batch_size_per_gpu() == 2
    assert engine.train_batch_size() == 4 and engine.local_rank == 0 and engine.device == torch.device("cpu")
    with pytest.raises(ConfigError, match="given twice"):
        megazero.initialize(args=args, model=model(), config=CFG)
    class Mpu:  # Megatron's model-parallel unit, here with 2 tensor-parallel ranks
        def __init__(self, tp):
            self.tp = tp

        def get_tensor_model_parallel_world_size(self):
            return self.tp

        def get_data_parallel_world_size(self):
            return 1

    with pytest.raises(ConfigError, match=r"mpu's layout \{'tp': 2, 'pp': 1, 'dp': 1\} differs"):
        megazero.initialize(model=model(), config=CFG, mpu=Mpu(2))
    engine, *_ = megazero.initialize(model=model(), config=CFG, mpu=Mpu(1))  # the config's layout: accepted
    engine, *_ = megazero.initialize(model=model(), config_params=CFG)
    assert engine.gradient_accumulation_steps() == 2


@pytest.mark.parametrize("stage", [0, 2])
def test_no_sync_and_the_accessors(stage):
    engine, *_ = megazero.initialize(model=model(), config={**CFG, "zero_optimization": {"stage": stage}})
    x = torch.randn(2, 4)
    if stage >= 2:
        with pytest.raises(RuntimeError, match="not compatible with ZeRO stage 2"):
            with engine.no_sync():
                pass
        return
    with engine.no_sync():
        engine.backward(engine(x).sum())  # accumulates, does not count towards the boundary
        with pytest.raises(RuntimeError, match="inside engine.no_sync"):
            engine.step()
    assert engine.micro_steps == 0 and engine.get_global_grad_norm() is None
    for _ in range(2):
        engine.backward(engine(x).sum())
        engine.step()
    assert engine.global_steps == 1 and engine.get_global_grad_norm() > 0
    assert engine.eval() is engine and not engine.module.training
    loss = engine.eval_batch(iter([(x,), (x,)]), loss_fn=lambda m, b: m(*b).sum())
    # fp32: the pipeline's eval sums the two micro-batches' losses in another order than one forward (~8 ulps)
    assert loss == pytest.approx(engine(x).sum().item(), rel=1e-6)


def test_zero_init_refuses_a_hugging_face_model_before_building_it():
    """HF's post_init would re-initialise partitions (the same draws on every rank): a clear error,
    raised before the model's constructor runs, naming the class and what to do instead."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=8)
    with pytest.raises(NotImplementedError, match="GPT2LMHeadModel is a Hugging Face model.*without zero.Init"):
        with megazero.zero.Init():
            GPT2LMHeadModel(config)
    GPT2LMHeadModel(config)  # outside the block, constructors are megazero-free again


def test_add_config_arguments_is_deepspeeds_and_leaves_local_rank_to_the_script(tmp_path):
    """DeepSpeed's tutorials add --local_rank themselves after add_config_arguments; DeepSpeed's own
    function adds --deepspeed, --deepspeed_config and the deprecated --deepscale(_config): the same here,
    so the script's own --local_rank does not collide ("conflicting option string")."""
    import json

    import deepspeed

    ours = megazero.add_config_arguments(argparse.ArgumentParser())
    theirs = deepspeed.add_config_arguments(argparse.ArgumentParser())
    assert sorted(a.dest for a in ours._actions) == sorted(a.dest for a in theirs._actions)
    ours.add_argument("--local_rank", type=int, default=-1)  # as the tutorials do
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CFG))
    args = ours.parse_args(["--deepscale_config", str(path), "--local_rank", "0"])
    engine, *_ = megazero.initialize(args=args, model=model())
    assert engine.gradient_accumulation_steps() == 2


def test_engine_accessors_deepspeed_scripts_read():
    """fp16_enabled / bfloat16_enabled / zero_optimization_stage, DeepSpeed's size attributes and
    global_samples, and set_gradient_accumulation_boundary's override of when step() updates."""
    cfg = dict(CFG, bf16={"enabled": True}, zero_optimization={"stage": 2})
    engine, *_ = megazero.initialize(model=model(), config=cfg)
    assert engine.bfloat16_enabled() and not engine.fp16_enabled() and engine.zero_optimization_stage() == 2
    assert (engine.global_rank, engine.world_size, engine.dp_world_size, engine.mp_world_size) == (0, 1, 1, 1)
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    for _ in range(4):  # two steps of two micro-batches
        engine.backward(engine(x).float().square().mean())
        engine.step()
    assert engine.global_steps == 2 and engine.global_samples == 2 * engine.train_batch_size()
    engine.set_gradient_accumulation_boundary(True)  # every micro-batch now ends a step
    engine.backward(engine(x).float().square().mean())
    engine.step()
    assert engine.global_steps == 3
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(engine(x).float().square().mean())
    engine.step()
    assert engine.global_steps == 3 and not engine.is_gradient_accumulation_boundary()
    fp32, *_ = megazero.initialize(model=model(), config=CFG)
    assert not fp32.bfloat16_enabled() and not fp32.fp16_enabled() and fp32.zero_optimization_stage() == 0
