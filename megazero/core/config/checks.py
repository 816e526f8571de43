"""Per-section value checks. Each ``check_*`` returns a list of messages, each starting with the
offending dotted key and saying what would be valid. `validate.validate` joins them.

These checks need no world size; the layout and the batch rule live in `validate`.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

from ..checkpoint_rules import checkpointing_problems
from ..spec_partition import partition_problems
from ..instructions import ScheduleError
from ..schedules import SCHEDULES, check_sizes
from ..suggest import did_you_mean
from .schema import (AXIS_CHOICES, BACKEND_CHOICES, CP_METHODS, NONFINITE_CHOICES, OFFLOAD_DEVICE_CHOICES, SILENT_ERROR_ACTIONS,
                     OPTIMIZER_CHOICES, PRECISION_CHOICES,
                     SCHEDULER_CHOICES, TOKENIZER_CHOICES, WARMUP_TYPE_CHOICES, Config)

_SPEC = re.compile(r"^[^:\s]+(\.py|[A-Za-z0-9_])(:[A-Za-z0-9_.\-]+)?$")


def choice(key: str, value: Any, choices: Sequence[str]) -> list[str]:
    """[] if `value` is one of `choices`, else a message naming the closest choice."""
    if value in choices:
        return []
    return [f"{key}: {value!r} is not valid{did_you_mean(str(value), choices)} (valid: {', '.join(choices)})"]


def at_least(key: str, value: Any, low: float, what: str = "") -> list[str]:
    """[] if `value` is None or >= `low`, else a message."""
    if value is None or value >= low:
        return []
    return [f"{key}: must be >= {low}{what}, got {value}"]


def check_parallel(cfg: Config) -> list[str]:
    p = cfg.parallel
    errs = at_least("parallel.pp", p.pp, 1) + at_least("parallel.tp", p.tp, 1) + at_least("parallel.dp", p.dp, 1)
    errs += at_least("parallel.ep", p.ep, 1) + at_least("parallel.ranks_per_node", p.ranks_per_node, 1)
    if p.expert_tp is not None and p.expert_tp not in (1, p.tp):
        errs.append(f"parallel.expert_tp: {p.expert_tp!r} is not valid (valid: 1, experts whole on every TP rank; "
                    f"or parallel.tp={p.tp}, each expert's ffn split over the TP group; unset means {p.tp})")
    if sorted(a for a in p.order if a != "cp") != sorted(AXIS_CHOICES) or list(p.order).count("cp") > 1:
        errs.append(f"parallel.order: {list(p.order)} must name each of {', '.join(AXIS_CHOICES)} once, and cp at "
                    f"most once (outermost first, e.g. [pp, dp, tp] or [pp, dp, cp, tp])")
    errs += at_least("parallel.cp", p.cp, 1) + choice("parallel.cp_method", p.cp_method, CP_METHODS)
    if p.sequence_parallel and p.tp < 2:
        errs.append(f"parallel.sequence_parallel: needs parallel.tp > 1 (got tp={p.tp}); sequence parallelism "
                    f"splits the sequence across the TP group")
    return errs


def check_data(cfg: Config) -> list[str]:
    if cfg.data.packed_documents and cfg.data.path is None:
        return ["data.packed_documents: needs documents, from data.path (a preprocessed corpus: its index records "
                "each document's boundaries); synthetic tokens (data.path unset) have none"]
    return []


def check_context_parallel(cfg: Config) -> list[str]:
    """What context parallelism (parallel.cp > 1) refuses before the model is known (the model's own rules:
    `megazero.core.config.spec_checks.check_model_and_schedule`)."""
    p, z = cfg.parallel, cfg.zero
    if not isinstance(p.cp, int) or p.cp < 2:
        return []
    if z.hpz_partition_size > 1:
        return [f"zero.hpz_partition_size={z.hpz_partition_size} with parallel.cp={p.cp}: ZeRO++'s secondary "
                f"partition is laid out over dp ranks alone, not yet over dp x cp; use 1 with context parallelism"]
    return []


def check_train(cfg: Config) -> list[str]:
    t = cfg.train
    errs = []
    for key in ("micro_batch_size", "gradient_accumulation_steps", "global_batch_size"):
        errs += at_least(f"train.{key}", getattr(t, key), 1)
    errs += at_least("train.steps", t.steps, 1) + at_least("train.seed", t.seed, 0)
    errs += at_least("train.eval_interval", t.eval_interval, 0, " (0 = no evaluation)")
    errs += at_least("train.eval_steps", t.eval_steps, 1)
    return errs


def check_model(cfg: Config) -> list[str]:
    m, p = cfg.model, cfg.parallel
    errs = []
    if m.spec is not None and not _SPEC.match(m.spec):
        errs.append(f"model.spec: {m.spec!r} is not a spec reference; write FILE.py[:FLAVOR] or "
                    f"package.module[:FLAVOR], e.g. model_specs/gpt.py:debug")
    for key in ("seq_len", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab"):
        errs += at_least(f"model.{key}", getattr(m, key), 1)
    if m.dropout is not None and not 0.0 <= m.dropout < 1.0:
        errs.append(f"model.dropout: must be in [0, 1), got {m.dropout}")
    if m.hidden and m.heads and m.hidden % m.heads:
        errs.append(f"model.hidden: {m.hidden} is not divisible by model.heads={m.heads}")
    if m.heads and m.kv_heads and m.heads % m.kv_heads:
        errs.append(f"model.kv_heads: model.heads={m.heads} is not divisible by kv_heads={m.kv_heads}")
    for key in ("heads", "kv_heads", "ffn_hidden"):
        value = getattr(m, key)
        if value and value % p.tp:
            errs.append(f"model.{key}: {value} is not divisible by parallel.tp={p.tp}")
    if p.sequence_parallel and m.seq_len and m.seq_len % p.tp:
        errs.append(f"model.seq_len: {m.seq_len} is not divisible by parallel.tp={p.tp} (sequence parallel)")
    errs += check_context_parallel(cfg)
    # whether the layers fill pp x chunks stages is the partition's rule (the embedding and the head are
    # pipeline layers too): spec_checks.py:_check_partition, with the spec
    typed = [f.name for f in dataclasses.fields(m) if f.name not in ("spec", "overrides")]
    for key in m.overrides:
        if key in typed:
            errs.append(f"model.overrides.{key}: duplicates the typed key model.{key}; use model.{key}")
    return errs


def check_zero(cfg: Config) -> list[str]:
    z = cfg.zero
    errs = [] if z.stage in (0, 1, 2, 3) else [f"zero.stage: must be 0, 1, 2 or 3, got {z.stage}"]
    for name in ("offload_optimizer", "offload_param"):
        device = getattr(z, name).device
        if device == "nvme":
            errs.append(f"zero.{name}.device: 'nvme': not supported yet (valid: none, cpu)")
        else:
            errs += choice(f"zero.{name}.device", device, OFFLOAD_DEVICE_CHOICES)
    zeropp = [k for k, on in (("quantized_weights", z.quantized_weights), ("quantized_gradients", z.quantized_gradients),
                               ("hpz_partition_size", z.hpz_partition_size != 1)) if on]
    if zeropp and z.stage != 3:
        errs.append(f"zero.{zeropp[0]}: ZeRO++ needs zero.stage=3 (got stage {z.stage})")
    errs += at_least("zero.hpz_partition_size", z.hpz_partition_size, 1)
    if z.offload_param.device != "none" and z.stage != 3:
        errs.append(f"zero.offload_param.device: offloading parameters needs zero.stage=3 (got stage {z.stage})")
    if z.offload_optimizer.device != "none" and z.stage < 1:
        errs.append("zero.offload_optimizer.device: offloading the optimizer needs zero.stage >= 1 (got stage 0)")
    for key in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size"):
        errs += at_least(f"zero.{key}", getattr(z, key), 1, " (elements)")
    for key in ("param_persistence_threshold", "sub_group_size", "max_live_parameters", "max_reuse_distance"):
        errs += at_least(f"zero.{key}", getattr(z, key), 0)
    return errs


def check_precision(cfg: Config) -> list[str]:
    f = cfg.fp16
    errs = choice("precision", cfg.precision, PRECISION_CHOICES)
    errs += at_least("fp16.loss_scale", f.loss_scale, 0, " (0 = dynamic)")
    if not 0 <= f.initial_scale_power <= 127:
        errs.append(f"fp16.initial_scale_power: must be in [0, 127] (scale 2**power), got {f.initial_scale_power}")
    errs += at_least("fp16.loss_scale_window", f.loss_scale_window, 1)
    errs += at_least("fp16.hysteresis", f.hysteresis, 1)
    if f.min_loss_scale <= 0:
        errs.append(f"fp16.min_loss_scale: must be > 0, got {f.min_loss_scale}")
    if cfg.gradient_clipping < 0:
        errs.append(f"gradient_clipping: must be >= 0 (0 = off), got {cfg.gradient_clipping}")
    errs += choice("nonfinite_gradients", cfg.nonfinite_gradients, NONFINITE_CHOICES)
    if cfg.nonfinite_gradients == "ignore" and cfg.precision == "fp16" and f.loss_scale == 0:
        errs.append("nonfinite_gradients: 'ignore' cannot go with fp16's dynamic loss scale (fp16.loss_scale=0), "
                    "which backs off on overflow and so needs the check; use skip or error, or a static "
                    "fp16.loss_scale")
    return errs


def check_optimizer(cfg: Config) -> list[str]:
    o = cfg.optimizer
    errs = choice("optimizer.type", o.type, OPTIMIZER_CHOICES)
    errs += at_least("optimizer.lr", o.lr, 0.0)
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        errs.append(f"optimizer.betas: must be two numbers in [0, 1), got {list(o.betas)}")
    if o.eps <= 0:
        errs.append(f"optimizer.eps: must be > 0, got {o.eps}")
    errs += at_least("optimizer.weight_decay", o.weight_decay, 0.0)
    if not 0.0 <= o.momentum < 1.0:
        errs.append(f"optimizer.momentum: must be in [0, 1), got {o.momentum}")
    elif o.momentum and o.type != "sgd":
        errs.append(f"optimizer.momentum: applies to optimizer.type=sgd only (type is {o.type}); "
                    f"Adam's momentum is optimizer.betas")
    if o.type == "adamw" and o.adamw_mode is False:
        errs.append("optimizer.adamw_mode: false contradicts optimizer.type=adamw (use type=adam for L2 decay)")
    errs += at_least("optimizer.freeze_step", o.freeze_step, 1, " (1-bit Adam's warm-up: the variance it freezes)")
    if o.type == "onebit_adam" and cfg.zero.stage != 0:
        errs.append(f"optimizer.type=onebit_adam: needs zero.stage 0 (got {cfg.zero.stage}), as DeepSpeed's 1-bit "
                    f"Adam: its ranks average the momentum of whole gradients, which stages 1-3 shard")
    if o.type == "onebit_adam" and cfg.parallel.ep > 1:
        errs.append(f"optimizer.type=onebit_adam: not with parallel.ep={cfg.parallel.ep} (experts average over a "
                    f"smaller group than their momentum would); use parallel.ep=1 or another optimizer")
    if o.type == "sgd" and o.adamw_mode is not None:
        errs.append("optimizer.adamw_mode: applies to adam/adamw, not optimizer.type=sgd")
    return errs


def check_scheduler(cfg: Config) -> list[str]:
    s, lr = cfg.scheduler, cfg.optimizer.lr
    errs = choice("scheduler.type", s.type, SCHEDULER_CHOICES)
    errs += choice("scheduler.warmup_type", s.warmup_type, WARMUP_TYPE_CHOICES)
    ds_warmup = s.type in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
    errs += at_least("scheduler.warmup_steps", s.warmup_steps, 1 if ds_warmup else 0,
                     f" with scheduler.type={s.type} (DeepSpeed's {s.type} refuses 0 and warms up over at least 2 "
                     f"steps)" if ds_warmup else "")
    errs += at_least("scheduler.total_steps", s.total_steps, 1)
    warmup_kinds = s.type in ("WarmupLR", "WarmupDecayLR")
    if s.warmup_max_lr is not None and not warmup_kinds:
        errs.append(f"scheduler.warmup_max_lr: applies to scheduler.type=WarmupLR and WarmupDecayLR only, not "
                    f"{s.type}; remove it")
    elif s.warmup_max_lr is not None and s.warmup_max_lr < 0:
        errs.append(f"scheduler.warmup_max_lr: must be >= 0, got {s.warmup_max_lr}")
    for key in ("min_lr", "warmup_min_lr"):
        value = getattr(s, key)
        if key == "warmup_min_lr" and warmup_kinds:
            # the peak: warmup_max_lr, or each parameter group's own lr (not known before the optimizer)
            if s.warmup_max_lr is None and value < 0:
                errs.append(f"scheduler.warmup_min_lr: must be >= 0, got {value}")
            elif s.warmup_max_lr is not None and not 0.0 <= value <= max(s.warmup_max_lr, 0.0):
                errs.append(f"scheduler.warmup_min_lr: must be in [0, scheduler.warmup_max_lr={s.warmup_max_lr}], "
                            f"got {value}")
        elif not 0.0 <= value <= max(lr, 0.0):
            errs.append(f"scheduler.{key}: must be in [0, optimizer.lr={lr}], got {value}")
    if s.type == "constant" and s.warmup_steps:
        errs.append(f"scheduler.warmup_steps: {s.warmup_steps} with scheduler.type=constant; "
                    f"use scheduler.type=WarmupLR for warmup then constant")
    total = s.total_steps if s.total_steps is not None else cfg.train.steps
    if s.type in ("linear", "cosine", "WarmupDecayLR") and total < s.warmup_steps:
        errs.append(f"scheduler.total_steps: {total} is shorter than scheduler.warmup_steps={s.warmup_steps}")
    if s.type in ("WarmupLR", "WarmupDecayLR") and s.min_lr != 0:
        errs.append(f"scheduler.min_lr: {s.type} takes none (as DeepSpeed's, WarmupDecayLR decays to "
                    f"scheduler.warmup_min_lr), got {s.min_lr}; set scheduler.warmup_min_lr")
    if s.type == "WarmupCosineLR":
        errs += _check_warmup_cosine(s)
    if s.type == "OneCycle":
        errs += _check_one_cycle(s)
    return errs


def _check_warmup_cosine(s) -> list[str]:
    errs = []
    for key in ("warmup_min_ratio", "cos_min_ratio"):
        value = getattr(s, key)
        if not 0.0 <= value <= 1.0:
            errs.append(f"scheduler.{key}: must be in [0, 1] (a fraction of each parameter group's lr), got {value}")
    return errs


def _check_one_cycle(s) -> list[str]:
    errs = []
    for key in ("cycle_min_lr", "cycle_max_lr"):
        value = getattr(s, key)
        if value is None:
            errs.append(f"scheduler.{key}: required by scheduler.type=OneCycle (DeepSpeed's OneCycle has no default)")
        elif value < 0:
            errs.append(f"scheduler.{key}: must be >= 0, got {value}")
    errs += at_least("scheduler.cycle_first_step_size", s.cycle_first_step_size, 1)
    errs += at_least("scheduler.cycle_second_step_size", s.cycle_second_step_size, 0, " (null: cycle_first_step_size)")
    errs += at_least("scheduler.decay_step_size", s.decay_step_size, 0, " (0 = no decay after the cycle)")
    errs += at_least("scheduler.decay_lr_rate", s.decay_lr_rate, 0)
    for key in ("cycle_min_mom", "cycle_max_mom") if s.cycle_momentum else ():
        value = getattr(s, key)
        if not 0.0 <= value < 1.0:
            errs.append(f"scheduler.{key}: must be in [0, 1) (Adam's beta1), got {value}")
    return errs


def check_activation_checkpointing(cfg: Config) -> list[str]:
    return checkpointing_problems(cfg.activation_checkpointing, cfg.parallel.sequence_parallel)



def check_partition(cfg: Config) -> list[str]:
    return partition_problems(cfg.pipeline.partition, cfg.parallel.pp * cfg.pipeline.chunks, cfg.model.layers)


def check_pipeline(cfg: Config) -> list[str]:
    pl = cfg.pipeline
    errs = [] if pl.schedule.endswith(".csv") else choice(
        "pipeline.schedule", pl.schedule, SCHEDULES + ("<file>.csv",))
    errs += at_least("pipeline.chunks", pl.chunks, 1)
    if not errs and pl.schedule in SCHEDULES and cfg.parallel.pp is not None and cfg.parallel.pp >= 1:
        errs += schedule_sizes(pl.schedule, cfg.parallel.pp, None, pl.chunks)  # m is checked once dp is known
    return errs + check_partition(cfg)


def schedule_sizes(schedule: str, pp: int, micro_batches: int | None, chunks: int) -> list[str]:
    """The schedule's own size rules (`megazero.core.schedules.check_sizes`) as config messages."""
    try:
        check_sizes(schedule, pp, micro_batches, chunks)
    except ScheduleError as err:
        return [f"{err.key}: {err}"]
    return []


def check_misc(cfg: Config) -> list[str]:
    errs = choice("data.tokenizer", cfg.data.tokenizer, TOKENIZER_CHOICES)
    errs += at_least("data.num_workers", cfg.data.num_workers, 0)
    errs += at_least("checkpoint.save_interval", cfg.checkpoint.save_interval, 0, " (0 = never)")
    errs += at_least("checkpoint.keep_last", cfg.checkpoint.keep_last, 0, " (0 = keep all)")
    errs += at_least("log.interval", cfg.log.interval, 1)
    if cfg.log.peak_tflops is not None and cfg.log.peak_tflops <= 0:
        errs.append(f"log.peak_tflops: must be > 0 (TFLOP/s per device), got {cfg.log.peak_tflops}")
    errs += at_least("comm.timeout_s", cfg.comm.timeout_s, 1)
    errs += choice("comm.backend", cfg.comm.backend, BACKEND_CHOICES)
    if cfg.name is not None and (not cfg.name or "/" in cfg.name):
        errs.append(f"name: {cfg.name!r} must be a non-empty name without '/' (it names runs/<name>)")
    if cfg.run_dir is not None and not cfg.run_dir:
        errs.append("run_dir: must not be empty (null = runs/<name>)")
    return errs


def check_resilience(cfg: Config) -> list[str]:
    r = cfg.resilience
    errs = at_least("resilience.straggler_interval", r.straggler_interval, 0, " (0 = off)")
    if r.straggler_ratio <= 1:
        errs.append(f"resilience.straggler_ratio: must be > 1 (compute over the median of its peers), got {r.straggler_ratio}")
    errs += at_least("resilience.link_probe_bytes", r.link_probe_bytes, 0, " (0 = no link probe)")
    errs += at_least("resilience.silent_error_interval", r.silent_error_interval, 0, " (0 = off)")
    if r.silent_error_spike != 0 and r.silent_error_spike <= 1:
        errs.append(f"resilience.silent_error_spike: must be > 1 (loss over the median of the last 20 steps) or 0 "
                    f"(off), got {r.silent_error_spike}")
    errs += choice("resilience.silent_error_action", r.silent_error_action, SILENT_ERROR_ACTIONS)
    errs += at_least("resilience.silent_error_rtol", r.silent_error_rtol, 0, " (0 = bitwise)")
    if (r.silent_error_interval or r.silent_error_spike) and cfg.zero.stage > 1:
        errs.append(f"resilience.silent_error_interval: the check compares each rank's own gradients, which ZeRO "
                    f"stage {cfg.zero.stage} reduce-scatters during the backward; use zero.stage 0 or 1, or turn the "
                    f"check off (0)")
    return errs


ALL_CHECKS = (check_parallel, check_train, check_model, check_zero, check_precision, check_optimizer,
              check_scheduler, check_activation_checkpointing, check_pipeline, check_misc, check_resilience, check_data)
