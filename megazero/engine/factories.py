"""From a resolved Config to the objects a run needs: model, optimizer, LR schedule, data.

Pure wiring; every part is usable alone (see each part's module).
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

from megazero.activation_checkpoint import ActivationCheckpointer
from megazero.core.config import Config, ConfigError
from megazero.core.instructions import ScheduleError
from megazero.core.moe_spec import MoESpecError
from megazero.core.schedules import get_schedule, splits_backward
from megazero.core.spec_partition import partition_problems, spec_bounds
from megazero.models.pipeline_from_spec import build_pipeline_model
from megazero.pipeline.pipeline_module import PipelineModule
from megazero.planner.from_config import spec_of
from megazero.planner.stages import logical_params
from megazero.runtime.parallel_context import ParallelContext
from megazero.tensor_parallel.weight_grad import WeightGradStore
from megazero.zero.loss_scaler import LossScaler
from megazero.zero.lr_schedule import ONE_CYCLE_PARAMS, LRScheduler
from megazero.zero.zeropp import ZeroPlusPlus
from megazero.zero.optimizer import OptimizerSpec, ZeroOptimizer
from megazero.zero.param_groups import megatron_param_groups

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(cfg: Config) -> torch.dtype:
    return DTYPES[cfg.precision]


def check_model_and_schedule(cfg: Config) -> None:
    """What `build_model` and the engine will need, checked before any process group exists: the
    spec loads and splits over the TP group, ``pipeline.partition`` splits its layers (the planner's
    `Layout` asks the same two functions), and the schedule builds for (pp, micro-batches, chunks).

    Raises:
        SpecError: naming the spec field; ConfigError: naming the config key of a schedule problem.
    """
    if cfg.model.spec is not None:
        spec = spec_of(cfg)
        _check_experts(spec.moe, cfg)  # first: its messages name the config keys
        spec.validate_layout(cfg.parallel.tp, cfg.parallel.sequence_parallel)
        _check_context_parallel(spec, cfg)
        _check_partition(spec, cfg)
    try:
        get_schedule(cfg.pipeline.schedule, cfg.parallel.pp, cfg.train.gradient_accumulation_steps,
                     cfg.pipeline.chunks)
    except ScheduleError as err:
        raise ConfigError(f"{err.key}: {err}") from None


def _check_partition(spec, cfg: Config) -> None:
    """``pipeline.partition`` against the spec's layers: a count list's length, sum and empty middle stages,
    and a method's split of the L + 2 pipeline layers (every virtual stage needs one; the split itself is
    the trainer's function, given the layers' parameter counts, which do not decide whether it exists)."""
    parts, part = cfg.parallel.pp * cfg.pipeline.chunks, cfg.pipeline.partition
    errs = partition_problems(part, parts, spec.layers)
    if not errs:
        try:
            spec_bounds(spec, cfg.parallel.pp, cfg.pipeline.chunks, part, logical_params(spec))
        except ValueError as err:
            errs = [f"pipeline.partition: {err}"]
    if errs:
        raise ConfigError("; ".join(errs))


def _check_context_parallel(spec, cfg: Config) -> None:
    """What context parallelism (parallel.cp > 1) needs of the model: a sequence of 2·cp equal chunks (each
    split again over tp under sequence parallelism); with Ulysses, query heads per tp rank divisible by cp; no
    dropout (its masks are drawn per whole sequence); MoE without capacity (counted per whole sequence)."""
    p = cfg.parallel
    if p.cp < 2:
        return
    errs = []
    chunk = 2 * p.cp * (p.tp if p.sequence_parallel else 1)
    if spec.seq_len % chunk:
        errs.append(f"model.seq_len: {spec.seq_len} must be a multiple of {chunk} = 2 x parallel.cp"
                    + (" x parallel.tp (sequence parallel)" if p.sequence_parallel else "")
                    + f": context parallelism gives each of the {p.cp} cp ranks a head and a tail chunk")
    heads = spec.heads // p.tp
    if p.cp_method == "ulysses" and heads % p.cp:
        errs.append(f"parallel.cp_method=ulysses: the {heads} attention heads per tensor-parallel rank (model.heads="
                    f"{spec.heads} / parallel.tp={p.tp}) must be a multiple of parallel.cp={p.cp}; use cp_method=ring")
    if spec.dropout or spec.attention_dropout:
        errs.append(f"model.dropout: {max(spec.dropout, spec.attention_dropout)} with parallel.cp={p.cp}: dropout "
                    f"masks are drawn per whole sequence, which no cp rank holds; use 0 with context parallelism")
    if spec.moe is not None and spec.moe.capacity_factor is not None:
        errs.append(f"model.moe.capacity_factor={spec.moe.capacity_factor} with parallel.cp={p.cp}: an expert's "
                    f"capacity is counted over each whole sequence, which no cp rank holds (not supported yet); "
                    f"use no capacity (null) with context parallelism")
    if errs:
        raise ConfigError("; ".join(errs))


def _check_experts(moe, cfg: Config) -> None:
    """The MoE rules of a layout: ep > 1 needs experts, the experts split over ep, no sequence parallelism
    (the router counts capacity per whole sequence)."""
    ep = cfg.parallel.ep
    if moe is None:
        if ep > 1:
            raise ConfigError(f"parallel.ep={ep}: expert parallelism needs a Mixture-of-Experts model; set "
                              f"model.moe.num_experts (a multiple of {ep})")
        return
    try:
        moe.check(ep)
    except MoESpecError as err:
        raise ConfigError(str(err)) from None
    drop = cfg.model.moe.drop_tokens
    if drop is False and cfg.model.moe.capacity_factor is not None:
        raise ConfigError(f"model.moe.drop_tokens=false with model.moe.capacity_factor={cfg.model.moe.capacity_factor}: "
                          f"no dropping has no capacity; set one of them")
    if drop is True and moe.capacity_factor is None:
        raise ConfigError("model.moe.drop_tokens=true: the spec has no capacity to drop past; set "
                          "model.moe.capacity_factor (e.g. 1.25)")
    if cfg.parallel.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel: not supported with model.moe yet (routing and capacity are "
                          "per whole sequence); set parallel.sequence_parallel=false")


def build_model(cfg: Config, pctx: ParallelContext, device=None, wrap_block=None) -> PipelineModule:
    """This rank's PipelineModule of the configured model spec. Unless `wrap_block` is given, the
    blocks are checkpointed as ``activation_checkpointing`` says. When the schedule splits backward
    into B and W (zero bubble), the linear layers are built with a `WeightGradStore`."""
    spec = spec_of(cfg)
    checkpointer = None
    if wrap_block is None:
        checkpointer = ActivationCheckpointer.from_config(cfg.activation_checkpointing, pctx.tp_group)
    programs = get_schedule(cfg.pipeline.schedule, pctx.pp_size, cfg.train.gradient_accumulation_steps,
                            cfg.pipeline.chunks)
    return build_pipeline_model(spec, pctx, seed=cfg.train.seed, sequence_parallel=cfg.parallel.sequence_parallel,
                                dtype=compute_dtype(cfg), partition=cfg.pipeline.partition,
                                chunks=cfg.pipeline.chunks, device=device, wrap_block=wrap_block,
                                activation_checkpointer=checkpointer,
                                wgrad_store=WeightGradStore() if splits_backward(programs) else None,
                                expert_tp=cfg.parallel.expert_tp, cp_method=cfg.parallel.cp_method,
                                packed_documents=cfg.data.packed_documents)


def loss_scaler(cfg: Config) -> LossScaler:
    if cfg.precision != "fp16":
        return LossScaler.static(1.0)
    f = cfg.fp16
    if f.loss_scale > 0:
        return LossScaler.static(f.loss_scale)
    return LossScaler.dynamic_from(f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.min_loss_scale)


def optimizer_spec(cfg: Config) -> OptimizerSpec:
    o = cfg.optimizer
    kind = o.type
    if kind in ("adam", "adamw"):
        kind = "adamw" if o.adamw_mode else "adam"
    return OptimizerSpec(kind, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                         momentum=o.momentum, freeze_step=o.freeze_step, bias_correction=o.bias_correction)


def zero_units(model: nn.Module) -> list[nn.Module]:
    """ZeRO-3 gathering units, in forward order: a PipelineModule's layers; else each element of the
    outermost ModuleLists / ModuleDicts (a transformer's blocks) with everything inside it, and every
    other module that owns parameters.

    Every rank must issue the same all-gathers (NCCL matches them by position). A user's model may
    skip modules depending on its data (Mixtral's experts that get no token, a conditional branch);
    inside a block that is one unit, such a module is gathered with the block on every rank, whether it
    runs or not."""
    if isinstance(model, PipelineModule):
        return model.units()
    units: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            units.extend(child for child in m.children() if any(True for _ in child.parameters()))
            return
        if any(True for _ in m.parameters(recurse=False)) or m.__dict__.get("zero_external_parameters"):
            units.append(m)  # owns parameters, or reads another's (zero.register_external_parameter)
        for child in m.children():
            visit(child)

    visit(model)
    return units


def param_groups(cfg: Config, model: nn.Module, params=None) -> list:
    """The optimizer's parameters: `params` (parameters or parameter groups, as the user gave them)
    or the model's; plain parameters are split by Megatron's rule (`megatron_param_groups`) when
    optimizer.no_decay_1d says so (unset: for models megazero built from a spec)."""
    given = list(params if params is not None else model.parameters())
    if any(isinstance(g, dict) for g in given):
        return given  # the user's groups decay exactly as they say
    rule = cfg.optimizer.no_decay_1d
    if rule is None:
        rule = isinstance(model, PipelineModule) and model.model_spec is not None  # built from a spec
    return megatron_param_groups(given, cfg.optimizer.weight_decay) if rule else given


def take_over(client, params) -> tuple[OptimizerSpec, list[dict]]:
    """The update rule and parameter groups of a client optimizer (an instance, or a callable that
    builds one from `params`), for the ZeRO optimizer to run instead. The groups are the client's own
    dicts, so a scheduler built on the client optimizer drives the ZeRO optimizer too. Only updates
    the ZeRO optimizer computes the same way are taken: torch's Adam, AdamW, SGD (no dampening,
    no nesterov), megazero's CPUAdam / FusedAdam; the client's own state (if it stepped) is not."""
    if not isinstance(client, torch.optim.Optimizer):
        if not callable(client):
            raise TypeError(f"initialize(optimizer=...): expected a torch.optim.Optimizer or a callable building one "
                            f"from the parameters, got {type(client).__name__}")
        client = client(params)
        if not isinstance(client, torch.optim.Optimizer):
            raise TypeError(f"initialize(optimizer=callable): it returned a {type(client).__name__}, not a "
                            "torch.optim.Optimizer")
    name, groups = type(client).__name__, client.param_groups
    first = groups[0]

    def same(key, default=None):
        values = {repr(g.get(key, default)) for g in groups}
        if len(values) > 1:
            raise ConfigError(f"initialize(optimizer={name}): parameter groups differ in {key} ({sorted(values)}); "
                              f"the ZeRO optimizer runs one {key} for all groups")
        return first.get(key, default)

    for key in ("amsgrad", "maximize", "nesterov"):
        if same(key, False):
            raise ConfigError(f"initialize(optimizer={name}({key}=True)): not supported by the ZeRO optimizer; "
                              f"use {key}=False")
    if isinstance(client, torch.optim.AdamW):
        kind = "adamw"
    elif isinstance(client, torch.optim.Adam):
        kind = "adamw" if same("decoupled_weight_decay", False) else "adam"
    elif isinstance(client, torch.optim.SGD):
        if same("dampening", 0.0):
            raise ConfigError(f"initialize(optimizer=SGD(dampening={first['dampening']})): the ZeRO optimizer's SGD "
                              "has no dampening; use dampening=0")
        kind = "sgd"
    elif "adamw_mode" in first:  # megazero.runtime.kernels.CPUAdam and megazero.ops.adam's classes
        kind = "adamw" if same("adamw_mode") else "adam"
    else:
        raise ConfigError(f"initialize(optimizer={name}): the ZeRO optimizer can take over torch.optim.Adam, AdamW "
                          f"and SGD, and megazero.ops.adam.FusedAdam / DeepSpeedCPUAdam; for {name}, use one of "
                          f"those or set the config's optimizer section")
    spec = OptimizerSpec(kind, lr=first["lr"], betas=tuple(first.get("betas", (0.9, 0.999))), eps=first.get("eps", 1e-8),
                         weight_decay=first.get("weight_decay", 0.0), momentum=first.get("momentum", 0.0),
                         bias_correction=bool(same("bias_correction", True)))
    return spec, groups


def build_optimizer(cfg: Config, model: nn.Module, pctx: ParallelContext, params=None,
                    spec: OptimizerSpec | None = None) -> ZeroOptimizer:
    """The ZeRO optimizer of `model` (or of `params`: parameters or groups) with the config's update
    rule, or `spec` (a client optimizer's, from `take_over`)."""
    z = cfg.zero
    return ZeroOptimizer(
        param_groups(cfg, model, params), pctx, stage=z.stage, spec=spec or optimizer_spec(cfg),
        reduce_bucket_size=z.reduce_bucket_size, allgather_bucket_size=z.allgather_bucket_size,
        overlap_comm=bool(z.overlap_comm), offload_optimizer=z.offload_optimizer.device == "cpu",
        offload_param=z.offload_param.device == "cpu", gradient_clipping=cfg.gradient_clipping,
        loss_scaler=loss_scaler(cfg), nonfinite=cfg.nonfinite_gradients, units=zero_units(model),
        prefetch_bucket_size=z.prefetch_bucket_size, param_persistence_threshold=z.param_persistence_threshold,
        zeropp=ZeroPlusPlus(z.quantized_weights, z.quantized_gradients,
                            pctx.hpz_group if z.hpz_partition_size > 1 else None),
        data_dependent_graph=not isinstance(model, PipelineModule),  # a user's module may skip parts per batch
        own_backward_only=not isinstance(model, PipelineModule))  # the module engine's: PyTorch's p.grad outside it


def build_scheduler(cfg: Config, optimizer) -> LRScheduler | None:
    """The configured schedule; none for "constant", so that every parameter group keeps its own lr
    (and a client's torch scheduler is the only one), as DeepSpeed without a scheduler section.
    WarmupCosineLR scales each group's own lr, and WarmupLR / WarmupDecayLR peak at it unless
    scheduler.warmup_max_lr is set (then at that, for every group), as DeepSpeed's do; linear, cosine
    and OneCycle set one lr for all groups (OneCycle as DeepSpeed's)."""
    s = cfg.scheduler
    if s.type == "constant":
        return None
    total = s.total_steps or cfg.train.steps
    if s.type == "WarmupCosineLR":
        return LRScheduler(optimizer, s.type, warmup_steps=s.warmup_steps, total_steps=total,
                           warmup_type=s.warmup_type, warmup_min_ratio=s.warmup_min_ratio,
                           cos_min_ratio=s.cos_min_ratio)
    if s.type == "OneCycle":
        return LRScheduler(optimizer, s.type, cycle_momentum=s.cycle_momentum,
                           **{k: getattr(s, k) for k in ONE_CYCLE_PARAMS})
    peak = s.warmup_max_lr if s.type in ("WarmupLR", "WarmupDecayLR") else cfg.optimizer.lr
    return LRScheduler(optimizer, s.type, peak, s.warmup_steps, total, s.min_lr, s.warmup_min_lr, s.warmup_type)


def synthetic_batches(vocab: int, micro_batch: int, gas: int, seq_len: int, seed: int, dp_rank: int,
                      dp_size: int, start_step: int = 0):
    """Endless random-token micro-batches (data.path unset: tests, benchmarks, parity checks).

    Global step k draws one global batch of dp_size·gas·micro_batch samples from a generator
    seeded by (seed, k); dp rank r takes samples [r·gas·mb, (r+1)·gas·mb) in micro-batches of mb,
    in order — the same split as the real data sampler, so every layout sees the same global batch.
    """
    for step in itertools.count(start_step):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        tokens = torch.randint(0, vocab, (dp_size * gas * micro_batch, seq_len + 1), generator=gen)
        mine = tokens[dp_rank * gas * micro_batch:(dp_rank + 1) * gas * micro_batch]
        for j in range(gas):
            mb = mine[j * micro_batch:(j + 1) * micro_batch]  # (micro_batch, seq_len + 1)
            yield {"input_ids": mb[:, :-1], "labels": mb[:, 1:]}
