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
from megazero.core.schedules import get_schedule, splits_backward
from megazero.core.spec import load_spec
from megazero.models.pipeline_from_spec import build_pipeline_model
from megazero.pipeline.pipeline_module import PipelineModule
from megazero.runtime.parallel_context import ParallelContext
from megazero.tensor_parallel.weight_grad import WeightGradStore
from megazero.zero.loss_scaler import LossScaler
from megazero.zero.lr_schedule import LRScheduler
from megazero.zero.optimizer import OptimizerSpec, ZeroOptimizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(cfg: Config) -> torch.dtype:
    return DTYPES[cfg.precision]


def model_spec(cfg: Config):
    """The ModelSpec named by model.spec with the config's architecture overrides (and seq_len)."""
    overrides = cfg.model.architecture()
    if cfg.model.seq_len is not None:
        overrides["seq_len"] = cfg.model.seq_len
    return load_spec(cfg.model.spec, overrides)


def check_model_and_schedule(cfg: Config) -> None:
    """What `build_model` and the engine will need, checked before any process group exists: the
    spec loads and splits over the TP group, and the schedule builds for (pp, micro-batches, chunks).

    Raises:
        SpecError: naming the spec field; ConfigError: naming the config key of a schedule problem.
    """
    if cfg.model.spec is not None:
        model_spec(cfg).validate_layout(cfg.parallel.tp, cfg.parallel.sequence_parallel)
    try:
        get_schedule(cfg.pipeline.schedule, cfg.parallel.pp, cfg.train.gradient_accumulation_steps,
                     cfg.pipeline.chunks)
    except ScheduleError as err:
        raise ConfigError(f"{err.key}: {err}") from None


def build_model(cfg: Config, pctx: ParallelContext, device=None, wrap_block=None) -> PipelineModule:
    """This rank's PipelineModule of the configured model spec. Unless `wrap_block` is given, the
    blocks are checkpointed as ``activation_checkpointing`` says. When the schedule splits backward
    into B and W (zero bubble), the linear layers are built with a `WeightGradStore`."""
    spec = model_spec(cfg)
    checkpointer = None
    if wrap_block is None:
        checkpointer = ActivationCheckpointer.from_config(cfg.activation_checkpointing, pctx.tp_group)
    programs = get_schedule(cfg.pipeline.schedule, pctx.pp_size, cfg.train.gradient_accumulation_steps,
                            cfg.pipeline.chunks)
    return build_pipeline_model(spec, pctx, seed=cfg.train.seed, sequence_parallel=cfg.parallel.sequence_parallel,
                                dtype=compute_dtype(cfg), partition=cfg.pipeline.partition,
                                chunks=cfg.pipeline.chunks, device=device, wrap_block=wrap_block,
                                activation_checkpointer=checkpointer,
                                wgrad_store=WeightGradStore() if splits_backward(programs) else None)


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
                         momentum=o.momentum)


def zero_units(model: nn.Module) -> list[nn.Module]:
    """ZeRO-3 gathering units: a PipelineModule's layers, else every module that owns parameters."""
    if isinstance(model, PipelineModule):
        return model.units()
    return [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]


def build_optimizer(cfg: Config, model: nn.Module, pctx: ParallelContext, params=None) -> ZeroOptimizer:
    z = cfg.zero
    return ZeroOptimizer(
        list(params if params is not None else model.parameters()), pctx, stage=z.stage, spec=optimizer_spec(cfg),
        reduce_bucket_size=z.reduce_bucket_size, allgather_bucket_size=z.allgather_bucket_size,
        overlap_comm=bool(z.overlap_comm), offload_optimizer=z.offload_optimizer.device == "cpu",
        offload_param=z.offload_param.device == "cpu", gradient_clipping=cfg.gradient_clipping,
        loss_scaler=loss_scaler(cfg), nonfinite=cfg.nonfinite_gradients, units=zero_units(model) if z.stage == 3 else None,
        prefetch_bucket_size=z.prefetch_bucket_size, param_persistence_threshold=z.param_persistence_threshold)


def build_scheduler(cfg: Config, optimizer) -> LRScheduler:
    s = cfg.scheduler
    return LRScheduler(optimizer, s.type, cfg.optimizer.lr, s.warmup_steps, s.total_steps or cfg.train.steps,
                       s.min_lr, s.warmup_min_lr, s.warmup_type)


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
