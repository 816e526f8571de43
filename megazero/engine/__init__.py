"""`megazero.initialize`: the DeepSpeed-shaped entry point.

    engine, optimizer, dataloader, lr_scheduler = megazero.initialize(model=..., config=...)

`model` is a model spec string ("model_specs/gpt.py:debug"), a `PipelineModule`, or any
`nn.Module` (tp = pp = 1: ZeRO 0-3 and offload work on any PyTorch model; tensor parallelism
needs megazero layers; its DeepSpeed-style `megazero.moe.layer.MoE` layers set parallel.ep from their
ep_size and get the expert-parallel group here). `config` is a path (YAML, megazero JSON or DeepSpeed JSON), a dict (merged
as data), or a `Config`. The config is resolved and validated once, with the model spec, before any
process group is created (`load_run_config`); `initialize_from_config` refuses what the given model cannot
run with (`megazero.core.config.initialize_checks`), then builds, top to bottom. Pipeline models get a
`PipelineEngine` (`train_batch` / `eval_batch`), other modules a `ModuleEngine` (`engine(batch)`,
`engine.backward(loss)`, `engine.step()`).
"""
from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

from megazero.core.config import Config, topology_of
from megazero.core.config.initialize_checks import BuiltModel, check_model, check_mpu, one_config_source
from megazero.core.config.spec_checks import load_for_run
from megazero.core.config.loading import read_file, read_tree
from megazero.core.launch_env import read_launch_env
from megazero.compat.monitor import MonitorMaster, check_installed
from megazero.compat.pipe_topology import as_megazero
from megazero.engine.factories import (build_model, build_optimizer, build_scheduler, compute_dtype, synthetic_batches,
                                       take_over)
from megazero.engine.kernel_plan import load_kernels
from megazero.engine.module_engine import ModuleEngine
from megazero.engine.pipeline_engine import PipelineEngine
from megazero.resilience.silent_check import SilentCheck
from megazero.moe.user_layer import MoE
from megazero.pipeline.pipeline_module import PipelineModule
from megazero.pipeline.stage_agreement import agree_on_stage
from megazero.runtime.device import compute_device
from megazero.runtime.launch import init_distributed, nccl_environment
from megazero.runtime.parallel_context import ParallelContext

__all__ = ["initialize", "initialize_from_config", "load_run_config", "data_iterator", "PipelineEngine", "ModuleEngine"]


def load_run_config(config, overrides=(), world_size: int | None = None) -> Config:
    """The resolved, validated Config of a path, dict or Config plus ``key=value`` `overrides`, with every
    refusal that needs only the config and the model spec raised (`megazero.core.config.spec_checks.
    load_for_run`). Needs no process group (the world size and the ranks per node come from the launcher's
    environment unless given)."""
    env = read_launch_env(os.environ)
    return load_for_run(config, overrides, world_size if world_size is not None else env.world_size,
                        env.local_world_size)


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               mpu=None, dist_init_required=None, collate_fn=None, config=None, config_params=None, *,
               overrides=(), on_instruction=None):
    """Build (engine, optimizer, dataloader, lr_scheduler), with DeepSpeed's arguments; see the
    module docstring.

    `config` (or DeepSpeed's `config_params`, or `args.deepspeed_config`): a path or a dict, in
    megazero's format or DeepSpeed's (told apart by its keys; a dict and the same file give the same
    Config). `optimizer`: a client optimizer (torch's Adam, AdamW or SGD, megazero.ops.adam's, or a
    callable returning one from the parameters) that the ZeRO optimizer takes over with its parameter
    groups and hyper-parameters. `lr_scheduler`: a scheduler instance (on the client optimizer or
    the returned one) or a callable taking the optimizer. `mpu` (Megatron's) is accepted when its
    sizes are the config's (megazero builds its own groups; `check_mpu`); `dist_init_required` is accepted (megazero initializes
    torch.distributed when it is not yet).
    """
    config = one_config_source(args, config, config_params)
    if isinstance(model, PipelineModule) and model.topology is not None:
        overrides = (*overrides, *_topology_overrides(model.topology, config, overrides))
    elif isinstance(model, PipelineModule) and not _sets_pp(config, overrides):
        overrides = (*overrides, f"parallel.pp={model.num_stages}")  # DeepSpeed: the module's num_stages decides
    cfg = load_run_config(config if config is not None else {}, overrides)
    if mpu is not None:
        check_mpu(mpu, cfg)
    return initialize_from_config(cfg, model, model_parameters, training_data, lr_scheduler, on_instruction,
                                  client_optimizer=optimizer, collate_fn=collate_fn)


def _sets_pp(config, overrides) -> bool:
    """Whether the config (or an override) sets the pipeline size itself (parallel.pp; DeepSpeed's
    pipeline.stages other than "auto")."""
    if any(str(o).split("=", 1)[0].strip() == "parallel.pp" for o in overrides):
        return True
    if isinstance(config, Config):
        return True
    if config is None:
        return False
    tree = read_tree(config)[0] if isinstance(config, dict) else read_file(config)[0]
    return tree.get("parallel", {}).get("pp") is not None


def _topology_overrides(topology, config, overrides) -> tuple[str, ...]:
    """The layout of a PipelineModule built with DeepSpeed's `topology` (pipe, data, model -> pp, dp,
    tp, in its order), as overrides; a config that sets parallel.pp itself must agree (checked with the
    module's num_stages by `megazero.core.config.initialize_checks.check_model`)."""
    t = as_megazero(topology)
    out = [f"parallel.tp={t.tp}", f"parallel.dp={t.dp}", f"parallel.order=[{','.join(t.order)}]"]
    return tuple(out if _sets_pp(config, overrides) else [f"parallel.pp={t.pp}", *out])


def initialize_from_config(cfg: Config, model=None, model_parameters=None, training_data=None, lr_scheduler=None,
                           on_instruction=None, client_optimizer=None, collate_fn=None, device=None, order=None):
    """`initialize` for a Config that `load_run_config` returned: loads (building if needed) the kernels
    the run uses (`load_kernels`, before any process group or collective), creates the process groups
    (`init_distributed`, then every group of the ParallelContext), builds or places the model, the
    ZeRO optimizer (taking over `client_optimizer` if given), the LR schedule and the engine.
    `on_instruction(ins, start_s, end_s)` sees every pipeline instruction (timers, traces).
    `device` (default: the launcher's, `init_distributed`) and `order` (what every group posts its
    operations to, see `ParallelContext`) are for the dry run (`megazero.toolbox.dry_run`: meta, a recorder)."""
    if model is not None and not isinstance(model, (str, nn.Module)):
        raise TypeError(f"model must be a spec string, a PipelineModule or an nn.Module, got {type(model).__name__}")
    moe_layers = _user_moe_layers(model)
    # every refusal about what was given, before any process group (the config's own: load_run_config)
    cfg = check_model(cfg, _described(model, moe_layers), client_optimizer is not None)
    check_installed(cfg.log)  # a monitor's package (tensorboard, wandb), before any process group
    spec = None
    if client_optimizer is not None:  # a built model's parameters: .to() below keeps the same Parameter objects
        spec, model_parameters = take_over(client_optimizer, model_parameters if model_parameters is not None
                                           else model.parameters())
    # the build, top to bottom
    env = read_launch_env(os.environ)
    if device is None:  # the dry run (device meta) computes nothing: no kernel to build
        here = compute_device(env, cfg.comm.backend)
        nccl_environment(cfg.comm.backend, here)  # before the kernels' load may create the CUDA context
        load_kernels(cfg, model, here, env.rank)
    info = init_distributed(cfg.comm.timeout_s, cfg.comm.backend, env)
    if device is not None:
        info = dataclasses.replace(info, device=torch.device(device))
    pctx = ParallelContext(topology_of(cfg), timeout_s=cfg.comm.timeout_s, ep=cfg.parallel.ep,
                           ranks_per_node=cfg.parallel.ranks_per_node or info.local_world_size,
                           hierarchical=cfg.comm.hierarchical, hpz=cfg.zero.hpz_partition_size,
                           verify_order=cfg.comm.verify_order or None, order=order)
    if isinstance(model, PipelineModule):  # the one refusal that needs a group: every rank's stage
        agree_on_stage(model.stage_index, pctx.pp_rank, pctx.global_rank, pctx.world_group, info.device)
    module = _model(model, cfg, pctx, info.device)
    for layer in moe_layers:  # DeepSpeed's engine: set_deepspeed_parallelism on every MoE layer
        layer.set_ep_group(pctx.ep_group)
    optimizer = build_optimizer(cfg, module, pctx, model_parameters, spec)
    scheduler = _scheduler(lr_scheduler, cfg, optimizer)
    t = cfg.train
    loader = _training_loader(training_data, cfg, pctx, collate_fn) if training_data is not None else None
    monitor = MonitorMaster(cfg.log, pctx.global_rank)
    r = cfg.resilience
    checking = r.silent_error_interval or r.silent_error_spike
    if isinstance(module, PipelineModule):
        check = SilentCheck(pctx.world_group, r.silent_error_interval, r.silent_error_spike, r.silent_error_action,
                            r.silent_error_rtol) if checking else None
        engine = PipelineEngine(module, pctx, optimizer, scheduler, t.gradient_accumulation_steps,
                                cfg.pipeline.schedule, cfg.pipeline.chunks, t.micro_batch_size, compute_dtype(cfg),
                                on_instruction=on_instruction, device=info.device, local_rank=info.local_rank,
                                training_data=loader, monitor=monitor, silent_check=check,
                                keep_step_rng=cfg.checkpoint.save_on_failure, config=cfg)
    else:
        engine = ModuleEngine(module, pctx, optimizer, scheduler, t.gradient_accumulation_steps, t.micro_batch_size,
                              info.local_rank, info.device, training_data=loader, monitor=monitor,
                              flops_profiler=cfg.log.flops_profiler, config=cfg)
    return engine, optimizer, loader if loader is not None else _dataloader(cfg, pctx, module, engine), scheduler


def _user_moe_layers(model) -> list[MoE]:
    """The DeepSpeed-style `MoE` layers (`megazero.moe.layer.MoE`) of a user's module; none for a spec."""
    return [m for m in model.modules() if isinstance(m, MoE)] if isinstance(model, nn.Module) else []


def _described(model, moe_layers: list[MoE]) -> BuiltModel:
    """`model` (None, a spec string, a PipelineModule or another nn.Module) as the checks see it."""
    if model is None or isinstance(model, str):
        return BuiltModel("none" if model is None else "spec", spec_ref=model)
    ep_sizes = tuple(m.ep_size for m in moe_layers)
    if isinstance(model, PipelineModule):
        return BuiltModel("pipeline", type(model).__name__, ep_sizes, model.num_stages, model.chunks,
                          model.activation_checkpointer is not None)
    return BuiltModel("module", type(model).__name__, ep_sizes)


def data_iterator(cfg: Config, engine, start_step: int):
    """The configured data of a spec model from global step `start_step` on (a resumed run's data
    position: batches depend only on the step), as `initialize` builds it for step 0."""
    return _dataloader(cfg, engine.pctx, engine.module, engine, start_step)


def _scheduler(lr_scheduler, cfg: Config, optimizer):
    """The configured schedule, or the client's: an instance, or a callable given the optimizer."""
    if lr_scheduler is None:
        return build_scheduler(cfg, optimizer)
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return lr_scheduler(optimizer)
    return lr_scheduler


def _model(model, cfg: Config, pctx: ParallelContext, device):
    """This rank's model on `device`: built from the config's model.spec (`model` None or a spec string,
    which `check_model` put in the config), or the given module placed and cast."""
    if model is None or isinstance(model, str):
        return build_model(cfg, pctx, device=device)  # each rank builds its own layers on its device
    # a model passed in built computes in the configured precision, as DeepSpeed casts it (module.half() /
    # .bfloat16()): its fp32 master weights start from the 16-bit values
    return model.to(device=device, dtype=compute_dtype(cfg))


def _training_loader(training_data, cfg: Config, pctx: ParallelContext, collate_fn=None):
    """DeepSpeed's loader of `training_data`: micro-batches of a DistributedSampler over the dp group
    (shuffled, seed 0, as DeepSpeed's), each batch made by `collate_fn`."""
    import torch.utils.data as tud

    sampler = tud.DistributedSampler(training_data, num_replicas=pctx.dp_size, rank=pctx.dp_rank)
    return tud.DataLoader(training_data, batch_size=cfg.train.micro_batch_size, sampler=sampler, collate_fn=collate_fn)


def _dataloader(cfg: Config, pctx: ParallelContext, module, engine, start_step: int = 0):
    """Spec models get the configured data (or synthetic tokens when data.path is unset), read only
    by the stages that need it, from global step `start_step` on; other models none."""
    t = cfg.train
    if not isinstance(module, PipelineModule) or module.model_spec is None:
        return None
    if not engine.needs_data():
        return None
    spec = module.model_spec
    if cfg.data.path is None:
        return synthetic_batches(spec.vocab, t.micro_batch_size, t.gradient_accumulation_steps, spec.seq_len, t.seed,
                                 pctx.dp_rank, pctx.dp_size, start_step=start_step)
    from megazero.data import build_data_iterator

    return build_data_iterator(cfg.data.path, spec.seq_len, t.micro_batch_size, t.gradient_accumulation_steps,
                               pctx.dp_rank, pctx.dp_size, t.seed, start_step=start_step, model_vocab=spec.vocab,
                               documents=cfg.data.packed_documents, num_workers=cfg.data.num_workers)
