"""From a resolved Config to the objects a run needs: model, optimizer, LR schedule, data.

Pure wiring; every part is usable alone (see each part's module).
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

from megazero.activation_checkpoint import ActivationCheckpointer
from megazero.core.config import Config
from megazero.core.config.initialize_checks import client_update_rule
from megazero.core.schedules import get_schedule, splits_backward
from megazero.core.spec import spec_of
from megazero.models.pipeline_from_spec import build_pipeline_model
from megazero.pipeline.pipeline_module import PipelineModule
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
    groups = client.param_groups
    if isinstance(client, torch.optim.AdamW):
        family = "adamw"
    elif isinstance(client, torch.optim.Adam):
        family = "adam"
    elif isinstance(client, torch.optim.SGD):
        family = "sgd"
    elif "adamw_mode" in groups[0]:  # megazero.runtime.kernels.CPUAdam and megazero.ops.adam's classes
        family = "megazero"
    else:
        family = None
    kind, hyper = client_update_rule(type(client).__name__, family, groups)
    return OptimizerSpec(kind, **hyper), groups


def build_optimizer(cfg: Config, model: nn.Module, pctx: ParallelContext, params=None,
                    spec: OptimizerSpec | None = None) -> ZeroOptimizer:
    """The ZeRO optimizer of `model` (or of `params`: parameters or groups) with the config's update
    rule, or `spec` (a client optimizer's, from `take_over`)."""
    z = cfg.zero
    return ZeroOptimizer(
        param_groups(cfg, model, params), pctx, stage=z.stage, spec=spec or optimizer_spec(cfg),
        reduce_bucket_size=z.reduce_bucket_size, allgather_bucket_size=z.allgather_bucket_size,
        overlap_comm=bool(z.overlap_comm), offload_optimizer=z.offload_optimizer.device == "cpu",
        offload_param=z.offload_param.device == "cpu", offload_optimizer_pin_memory=z.offload_optimizer.pin_memory,
        offload_param_pin_memory=z.offload_param.pin_memory, gradient_clipping=cfg.gradient_clipping,
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
