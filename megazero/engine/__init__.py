"""`megazero.initialize`: the DeepSpeed-shaped entry point.

    engine, optimizer, dataloader, lr_scheduler = megazero.initialize(model=..., config=...)

`model` is a model spec string ("model_specs/gpt.py:debug"), a `PipelineModule`, or any
`nn.Module` (tp = pp = 1: ZeRO 0-3 and offload work on any PyTorch model; tensor parallelism
needs megazero layers). `config` is a path (YAML, megazero JSON or DeepSpeed JSON), a dict, or a
`Config`. The config is validated before any process group is created. Pipeline models get a
`PipelineEngine` (`train_batch` / `eval_batch`), other modules a `ModuleEngine`
(`engine(batch)`, `engine.backward(loss)`, `engine.step()`).
"""
from __future__ import annotations

from torch import nn

from megazero.activation_checkpoint import max_live_forwards
from megazero.core.config import Config, ConfigError, assert_supported, load_config, resolve
from megazero.engine.factories import (build_model, build_optimizer, build_scheduler, compute_dtype,
                                   synthetic_batches)
from megazero.engine.module_engine import ModuleEngine
from megazero.engine.pipeline_engine import PipelineEngine
from megazero.run.launch import detect, init_distributed
from megazero.runtime.parallel_context import ParallelContext
from megazero.pipeline.pipeline_module import PipelineModule
from megazero.core.topology import Topology

__all__ = ["initialize", "load_run_config", "PipelineEngine", "ModuleEngine"]


def dict_to_overrides(tree: dict, prefix: str = "") -> list[str]:
    """{"zero": {"stage": 2}} -> ["zero.stage=2"]: a dict config goes through the same checks as
    a file (unknown keys, types)."""
    out = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += dict_to_overrides(value, name + ".")
        else:
            out.append(f"{name}={_yaml_scalar(value)}")
    return out


def _yaml_scalar(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_yaml_scalar(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{}"
    return str(v)


def load_run_config(config, overrides=(), world_size: int | None = None) -> Config:
    """A resolved, validated Config from a path, dict or Config (no process group needed)."""
    world = world_size if world_size is not None else detect()[1]
    if isinstance(config, Config):
        cfg = resolve(config, world)
    elif isinstance(config, dict):
        cfg = load_config(None, dict_to_overrides(config) + list(overrides), world_size=world)
    else:
        cfg = load_config(config, list(overrides), world_size=world)
    assert_supported(cfg)
    return cfg


def initialize(model=None, config=None, model_parameters=None, training_data=None, lr_scheduler=None,
               overrides=(), on_instruction=None):
    """Build (engine, optimizer, dataloader, lr_scheduler); see the module docstring."""
    cfg = load_run_config(config if config is not None else {}, overrides)
    p = cfg.parallel
    topology = Topology(pp=p.pp, dp=p.dp, tp=p.tp, order=tuple(p.order))
    if isinstance(model, nn.Module) and not isinstance(model, PipelineModule) and (p.tp > 1 or p.pp > 1):
        raise ConfigError(f"parallel.tp={p.tp}, parallel.pp={p.pp}: a plain nn.Module runs with tp = pp = 1 "
                          f"only; build it from megazero layers (a model spec or a PipelineModule)")
    info = init_distributed(cfg.comm.timeout_s, cfg.comm.backend)
    ctx = ParallelContext(topology, timeout_s=cfg.comm.timeout_s)
    module = _model(model, cfg, ctx, info.device)
    policy = cfg.activation_checkpointing.policy
    if policy != "none" and getattr(module, "activation_checkpointer", None) is None:
        raise ConfigError(f"activation_checkpointing.policy={policy}: the model was passed in already built, so "
                          f"initialize cannot checkpoint it; build it with build_pipeline_model(..., "
                          f"activation_checkpointer=ActivationCheckpointer.from_config(...)) or pass a model spec")
    optimizer = build_optimizer(cfg, module, ctx, model_parameters)
    scheduler = lr_scheduler if lr_scheduler is not None else build_scheduler(cfg, optimizer)
    t = cfg.train
    if isinstance(module, PipelineModule):
        seq = module.spec.seq_len if hasattr(module, "spec") else None
        shape = module.activation_shape(t.micro_batch_size, seq) if hasattr(module, "activation_shape") else None
        engine = PipelineEngine(module, ctx, optimizer, scheduler, t.gradient_accumulation_steps,
                                cfg.pipeline.schedule, cfg.pipeline.chunks, shape, compute_dtype(cfg),
                                on_instruction=on_instruction, device=info.device)
        checkpointer = getattr(module, "activation_checkpointer", None)
        if checkpointer is not None:  # the contiguous checkpoint buffer holds the micro-batches in flight
            checkpointer.set_in_flight(max_live_forwards(engine.program))
    else:
        engine = ModuleEngine(module, ctx, optimizer, scheduler, t.gradient_accumulation_steps)
    engine.cfg = cfg
    return engine, optimizer, _dataloader(training_data, cfg, ctx, module, engine), scheduler


def _model(model, cfg: Config, ctx, device):
    if model is None or isinstance(model, str):
        if isinstance(model, str):
            cfg = _with_spec(cfg, model)
        if cfg.model.spec is None:
            raise ConfigError("model.spec: no model given; pass model=... or set model.spec "
                              "(e.g. model.spec=model_specs/gpt.py:debug)")
        return build_model(cfg, ctx, device=device)  # each rank builds its own layers on its device
    if isinstance(model, PipelineModule):
        return model.to(device)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a spec string, a PipelineModule or an nn.Module, got {type(model).__name__}")
    return model.to(device=device, dtype=compute_dtype(cfg))


def _with_spec(cfg: Config, spec: str) -> Config:
    import dataclasses

    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, spec=spec))


def _dataloader(training_data, cfg: Config, ctx, module, engine):
    """DeepSpeed returns a loader for `training_data`; spec models get the configured data (or
    synthetic tokens when data.path is unset), read only by the stages that need it."""
    t = cfg.train
    if training_data is not None:
        import torch.utils.data as tud

        sampler = tud.DistributedSampler(training_data, num_replicas=ctx.dp_size, rank=ctx.dp_rank, shuffle=False)
        return tud.DataLoader(training_data, batch_size=t.micro_batch_size, sampler=sampler, drop_last=True)
    if not isinstance(module, PipelineModule) or not hasattr(module, "spec"):
        return None
    if isinstance(engine, PipelineEngine) and not engine.needs_data():
        return None
    spec = module.spec
    if cfg.data.path is None:
        return synthetic_batches(spec.vocab, t.micro_batch_size, t.gradient_accumulation_steps, spec.seq_len, t.seed,
                                 ctx.dp_rank, ctx.dp_size)
    from megazero.data import build_data_iterator

    return build_data_iterator(cfg.data.path, spec.seq_len, t.micro_batch_size, t.gradient_accumulation_steps,
                               ctx.dp_rank, ctx.dp_size, t.seed, start_step=0, model_vocab=spec.vocab)
