"""`megazero.initialize`: the DeepSpeed-shaped entry point.

    engine, optimizer, dataloader, lr_scheduler = megazero.initialize(model=..., config=...)

`model` is a model spec string ("model_specs/gpt.py:debug"), a `PipelineModule`, or any
`nn.Module` (tp = pp = 1: ZeRO 0-3 and offload work on any PyTorch model; tensor parallelism
needs megazero layers; its DeepSpeed-style `megazero.moe.layer.MoE` layers set parallel.ep from their
ep_size and get the expert-parallel group here). `config` is a path (YAML, megazero JSON or DeepSpeed JSON), a dict (merged
as data), or a `Config`. The config is resolved and validated once, before any process group is
created (`load_run_config`); `initialize_from_config` takes it from there. Pipeline models get a
`PipelineEngine` (`train_batch` / `eval_batch`), other modules a `ModuleEngine` (`engine(batch)`,
`engine.backward(loss)`, `engine.step()`).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megazero.core.config import Config, ConfigError, assert_supported, load_config, resolve, topology_of
from megazero.core.config.loading import read_file, read_tree
from megazero.compat.monitor import MonitorMaster, check_installed
from megazero.compat.pipe_topology import as_megazero
from megazero.core.topology import Topology
from megazero.engine.factories import (build_model, build_optimizer, build_scheduler, check_model_and_schedule,
                                       compute_dtype, synthetic_batches, take_over)
from megazero.engine.kernel_plan import load_kernels
from megazero.engine.module_engine import ModuleEngine
from megazero.engine.pipeline_engine import PipelineEngine
from megazero.engine.silent_check import SilentCheck
from megazero.moe.user_layer import MoE
from megazero.pipeline.pipeline_module import PipelineModule
from megazero.run.launch import detect, init_distributed, local_device, nccl_environment
from megazero.runtime import comm
from megazero.runtime.parallel_context import ParallelContext

__all__ = ["initialize", "initialize_from_config", "load_run_config", "data_iterator", "PipelineEngine", "ModuleEngine"]


def load_run_config(config, overrides=(), world_size: int | None = None) -> Config:
    """The resolved, validated Config of a path, dict or Config plus ``key=value`` `overrides`,
    refusing features not supported yet, with its model spec and schedule checked
    (`check_model_and_schedule`). Needs no process group (the world size comes from the launcher's
    environment unless given)."""
    world = world_size if world_size is not None else detect()[1]
    if isinstance(config, Config):
        if overrides:
            raise ConfigError(f"overrides {list(overrides)}: a Config is used as it is; apply key=value overrides "
                              f"to a config file or dict, or change the Config with dataclasses.replace")
        cfg = resolve(config, world)
    else:
        cfg = load_config(config, list(overrides), world_size=world)
    assert_supported(cfg)
    check_model_and_schedule(cfg)
    return cfg


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
    sizes are the config's (megazero builds its own groups; `_check_mpu`); `dist_init_required` is accepted (megazero initializes
    torch.distributed when it is not yet).
    """
    config = _config_source(args, config, config_params)
    if isinstance(model, PipelineModule) and model.topology is not None:
        overrides = (*overrides, *_topology_overrides(model.topology, config, overrides))
    elif isinstance(model, PipelineModule) and not _sets_pp(config, overrides):
        overrides = (*overrides, f"parallel.pp={model.num_stages}")  # DeepSpeed: the module's num_stages decides
    cfg = load_run_config(config if config is not None else {}, overrides)
    if mpu is not None:
        _check_mpu(mpu, cfg)
    return initialize_from_config(cfg, model, model_parameters, training_data, lr_scheduler, on_instruction,
                                  client_optimizer=optimizer, collate_fn=collate_fn)


def _check_mpu(mpu, cfg: Config) -> None:
    """A Megatron-style `mpu` (DeepSpeed's model-parallel unit) is accepted when it describes the
    config's layout: megazero builds its own groups from parallel.pp / tp / dp, so an mpu with other
    sizes is refused, naming them (before any process group of megazero's exists)."""
    def size(*names):
        for name in names:
            if hasattr(mpu, name):
                return int(getattr(mpu, name)())
        return 1

    theirs = {"tp": size("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"),
              "pp": size("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size"),
              "dp": size("get_data_parallel_world_size")}
    ours = {"tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "dp": cfg.parallel.dp}
    if theirs != ours:
        raise ConfigError(f"initialize(mpu=...): the mpu's layout {theirs} differs from the config's parallel section "
                          f"{ours}; megazero builds its own process groups from parallel.pp / parallel.tp / "
                          f"parallel.dp: set them to the mpu's sizes (or pass mpu=None)")


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
    module's num_stages by `_check_pipeline_module`)."""
    t = as_megazero(topology)
    out = [f"parallel.tp={t.tp}", f"parallel.dp={t.dp}", f"parallel.order=[{','.join(t.order)}]"]
    return tuple(out if _sets_pp(config, overrides) else [f"parallel.pp={t.pp}", *out])


def _config_source(args, config, config_params):
    """The one config given: `config`, `config_params` (DeepSpeed's older name) or
    `args.deepspeed_config` (DeepSpeed's command-line flag; `args.deepscale_config`, its deprecated name)."""
    given = {"config": config, "config_params": config_params,
             "args.deepspeed_config": getattr(args, "deepspeed_config", None) if args is not None else None,
             "args.deepscale_config": getattr(args, "deepscale_config", None) if args is not None else None}
    present = [k for k, v in given.items() if v is not None]
    if len(present) > 1:
        raise ConfigError(f"initialize: a config was given twice ({' and '.join(present)}); pass one of them")
    return given[present[0]] if present else None


def initialize_from_config(cfg: Config, model=None, model_parameters=None, training_data=None, lr_scheduler=None,
                           on_instruction=None, client_optimizer=None, collate_fn=None, device=None, order=None):
    """`initialize` for a Config that `load_run_config` returned: loads (building if needed) the kernels
    the run uses (`load_kernels`, before any process group or collective), creates the process groups
    (`init_distributed`, then every group of the ParallelContext), builds or places the model, the
    ZeRO optimizer (taking over `client_optimizer` if given), the LR schedule and the engine.
    `on_instruction(ins, start_s, end_s)` sees every pipeline instruction (timers, traces).
    `device` (default: the launcher's, `init_distributed`) and `order` (what every group posts its
    operations to, see `ParallelContext`) are for the dry run (`megazero.run.dry_run`: meta, a recorder)."""
    moe_layers = _user_moe_layers(model)
    if moe_layers:
        cfg = _with_expert_parallel(cfg, moe_layers, model)
    p = cfg.parallel
    topology = topology_of(cfg)
    if p.cp > 1 and isinstance(model, nn.Module):
        raise ConfigError(f"parallel.cp={p.cp}: context parallelism splits each sequence inside megazero's own "
                          f"attention; pass a model spec (model.spec), not a built {type(model).__name__}")
    if isinstance(model, str):  # a spec named here instead of in the config: check it like load_run_config
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, spec=model))
        check_model_and_schedule(cfg)
    elif isinstance(model, PipelineModule):
        _check_pipeline_module(model, cfg)
    elif isinstance(model, nn.Module) and (p.tp > 1 or p.pp > 1):
        raise ConfigError(f"parallel.tp={p.tp}, parallel.pp={p.pp}: a plain nn.Module runs with tp = pp = 1 "
                          f"only; build it from megazero layers (a model spec or a PipelineModule)")
    elif isinstance(model, nn.Module) and p.ep > 1 and not moe_layers:
        raise ConfigError(f"parallel.ep={p.ep} (DeepSpeed: expert_parallel.autoep_size): a plain nn.Module keeps its "
                          f"own MoE blocks, which megazero cannot split over ranks; build its MoE layers with "
                          f"megazero.moe.layer.MoE (DeepSpeed's, with ep_size), or the model from a megazero MoE "
                          f"spec (e.g. model_specs/llama.py:mixtral-8x7b; a Hugging Face Mixtral's weights load "
                          f"with megazero.models.hf.load_hf_state_dict), or set parallel.ep=1")
    elif model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be a spec string, a PipelineModule or an nn.Module, got {type(model).__name__}")
    policy = cfg.activation_checkpointing.policy
    built = isinstance(model, nn.Module)
    if policy != "none" and built and (not isinstance(model, PipelineModule) or model.activation_checkpointer is None):
        raise ConfigError(f"activation_checkpointing.policy={policy}: the model was passed in already built, so "
                          f"initialize cannot checkpoint it; build it with build_pipeline_model(..., "
                          f"activation_checkpointer=ActivationCheckpointer.from_config(...)) or pass a model spec")
    _check_hpz_in_a_node(cfg, topology)
    check_installed(cfg.log)  # a monitor's package (tensorboard, wandb), before any process group
    if cfg.log.flops_profiler.enabled and isinstance(model, PipelineModule) or (
            cfg.log.flops_profiler.enabled and (model is None or isinstance(model, str))):
        raise ConfigError("log.flops_profiler.enabled (DeepSpeed: flops_profiler.enabled): the profiler counts one "
                          "module's forward, which a pipeline splits over its stages' instructions; it runs with "
                          "a plain nn.Module (use log.peak_tflops for the trainer's MFU)")
    if device is None:  # the dry run (device meta) computes nothing: no kernel to build
        nccl_environment(cfg.comm.backend)  # before the kernels' load may create the CUDA context
        load_kernels(cfg, model, local_device(cfg.comm.backend))
    info = init_distributed(cfg.comm.timeout_s, cfg.comm.backend)
    if device is not None:
        info = dataclasses.replace(info, device=torch.device(device))
    pctx = ParallelContext(topology, timeout_s=cfg.comm.timeout_s, ep=cfg.parallel.ep,
                           ranks_per_node=cfg.parallel.ranks_per_node or info.local_world_size,
                           hierarchical=cfg.comm.hierarchical, hpz=cfg.zero.hpz_partition_size,
                           verify_order=cfg.comm.verify_order or None, order=order)
    if isinstance(model, PipelineModule):
        _agree_on_stage(model, pctx, info.device)
    module = _model(model, cfg, pctx, info.device)
    for layer in moe_layers:  # DeepSpeed's engine: set_deepspeed_parallelism on every MoE layer
        layer.set_ep_group(pctx.ep_group)
    spec = None
    if client_optimizer is not None:
        spec, model_parameters = take_over(client_optimizer, model_parameters if model_parameters is not None
                                           else module.parameters())
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
        if checking:
            raise ConfigError("resilience.silent_error_interval / silent_error_spike: the check reruns a pipeline "
                              "program (megazero's models, a PipelineModule); a plain nn.Module's engine runs the "
                              "user's own forward and backward, which it cannot replay")
        engine = ModuleEngine(module, pctx, optimizer, scheduler, t.gradient_accumulation_steps, t.micro_batch_size,
                              info.local_rank, info.device, training_data=loader, monitor=monitor,
                              flops_profiler=cfg.log.flops_profiler, config=cfg)
    return engine, optimizer, loader if loader is not None else _dataloader(cfg, pctx, module, engine), scheduler


def _user_moe_layers(model) -> list[MoE]:
    """The DeepSpeed-style `MoE` layers (`megazero.moe.layer.MoE`) of a user's module; none for a spec."""
    return [m for m in model.modules() if isinstance(m, MoE)] if isinstance(model, nn.Module) else []


def _with_expert_parallel(cfg: Config, layers: list[MoE], model: nn.Module) -> Config:
    """`cfg` with parallel.ep taken from the model's MoE layers' ep_size, as DeepSpeed takes it (before any
    process group). Every layer must have the same ep_size (megazero builds one expert-parallel group),
    the config may not ask for another, and ep_size must divide dp."""
    sizes = sorted({m.ep_size for m in layers})
    if len(sizes) > 1:
        raise ConfigError(f"MoE layers with ep_size {sizes}: megazero builds one expert-parallel group per model "
                          f"(DeepSpeed: one per ep_size); give every MoE layer the same ep_size")
    ep = sizes[0]
    if cfg.parallel.ep not in (1, ep):
        raise ConfigError(f"parallel.ep={cfg.parallel.ep} (DeepSpeed: expert_parallel.autoep_size), but the model's "
                          f"MoE layers have ep_size={ep}; the layers decide: leave parallel.ep unset or set it to {ep}")
    if ep > 1 and isinstance(model, PipelineModule):
        raise ConfigError(f"MoE(ep_size={ep}) inside a PipelineModule: expert parallelism runs in a plain nn.Module "
                          f"(any ZeRO stage) or in a model built from a megazero MoE spec; use ep_size=1 here")
    try:
        return resolve(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep=ep)))
    except ConfigError as err:
        raise ConfigError(f"MoE layers' ep_size={ep} (parallel.ep is taken from them): {err}") from None


def data_iterator(cfg: Config, engine, start_step: int):
    """The configured data of a spec model from global step `start_step` on (a resumed run's data
    position: batches depend only on the step), as `initialize` builds it for step 0."""
    return _dataloader(cfg, engine.pctx, engine.module, engine, start_step)


def _check_hpz_in_a_node(cfg: Config, topology: Topology) -> None:
    """ZeRO++'s hpZ groups (runs of zero.hpz_partition_size consecutive dp ranks) must each sit in one node,
    or the secondary partition costs memory and saves no inter-node byte (before any process group)."""
    k = cfg.zero.hpz_partition_size
    if k <= 1:
        return
    per_node = cfg.parallel.ranks_per_node or detect()[3]
    for run in topology.data_parallel_runs(k):
        if len({r // per_node for r in run}) > 1:
            stride = run[1] - run[0]  # consecutive dp ranks this far apart (tp, or pp x tp in another order)
            raise ConfigError(f"zero.hpz_partition_size={k}: its groups span nodes of {per_node} ranks (dp ranks are "
                              f"{stride} ranks apart); use at most {max(1, per_node // stride)}, the dp ranks of one "
                              f"node, or set parallel.ranks_per_node")


def _check_pipeline_module(module: PipelineModule, cfg: Config) -> None:
    """A user's PipelineModule must be cut as the config's pipeline is (before any process group)."""
    for what, mine, key, theirs in (("num_stages", module.num_stages, "parallel.pp", cfg.parallel.pp),
                                    ("chunks", module.chunks, "pipeline.chunks", cfg.pipeline.chunks)):
        if mine != theirs:
            raise ConfigError(f"{key}={theirs}, but the PipelineModule was built with {what}={mine}; "
                              f"build it with {what}={theirs} or set {key}={mine}")


def _agree_on_stage(module: PipelineModule, pctx: ParallelContext, device) -> None:
    """Every rank's PipelineModule must be built for its own pipeline stage; the ranks agree (max of a
    flag over the world group), so that all of them stop with the error, not only the wrong ones."""
    wrong = module.stage_index != pctx.pp_rank
    flag = torch.tensor([1.0 if wrong else 0.0], device=device)
    comm.all_reduce(flag, pctx.world_group, op="max")
    if flag.item() > 0:
        mine = (f"this rank's module was built with stage={module.stage_index}, its pipeline stage is {pctx.pp_rank}"
                if wrong else "another rank's module was built for another stage")
        raise ConfigError(f"PipelineModule stage (global rank {pctx.global_rank}): {mine}; build each rank's module "
                          f"with stage = Topology(pp=..., dp=..., tp=..., order=...).coords(rank).pp")


def _scheduler(lr_scheduler, cfg: Config, optimizer):
    """The configured schedule, or the client's: an instance, or a callable given the optimizer."""
    if lr_scheduler is None:
        return build_scheduler(cfg, optimizer)
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return lr_scheduler(optimizer)
    return lr_scheduler


def _model(model, cfg: Config, pctx: ParallelContext, device):
    if model is None or isinstance(model, str):
        if cfg.model.spec is None:
            raise ConfigError("model.spec: no model given; pass model=... or set model.spec "
                              "(e.g. model.spec=model_specs/gpt.py:debug)")
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
                               documents=cfg.data.packed_documents)
