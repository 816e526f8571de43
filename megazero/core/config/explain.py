"""`explain`: the resolved config and its derived values (dp size, micro-batches per flush, bubble, model FLOPs).

The bubble is the pipeline simulator's, measured from the schedule's own programs with unit costs
(`megazero.core.schedules.bubble_fraction`), so that a .csv schedule has one too; the closed forms it
reaches for m >= p are in docs/reference.md.
"""
from __future__ import annotations

from typing import Optional, Sequence

from megazero.planner.from_config import memory_lines, predicted_memory
from megazero.planner.layout import PlanError

from ..flops import hardware_flops_per_step, model_flops_per_step, model_flops_per_token
from ..instructions import ScheduleError
from ..spec import SpecError, spec_of
from ..schedules import bubble_fraction
from .errors import ConfigError
from .schema import Config
from .supported import unsupported
from .tree import to_yaml
from .validate import resolve


def derived_values(cfg: Config) -> dict[str, object]:
    """The numbers `explain` prints for a resolved config."""
    pl, p = cfg.pipeline, cfg.parallel.pp
    m = cfg.train.gradient_accumulation_steps
    world = p * cfg.parallel.tp * cfg.parallel.dp * cfg.parallel.cp
    try:
        bubble = round(bubble_fraction(pl.schedule, p, m, pl.chunks), 6)
    except ScheduleError as err:
        raise ConfigError(f"pipeline.schedule={pl.schedule!r}: {err}") from None
    return {"world_size": world, "dp_size": cfg.parallel.dp, "micro_batches_per_flush": m,
            "pipeline_schedule": pl.schedule, "bubble_fraction": bubble}


def flops_lines(cfg: Config) -> list[str]:
    """The model FLOPs of one step of resolved `cfg` (`megazero.core.flops`: what the trainer's MFU and the
    planner's predicted MFU count) and the hardware FLOPs under its recompute policy; [] without a spec."""
    if cfg.model.spec is None:
        return []
    try:
        spec = spec_of(cfg)
    except SpecError:
        return []
    batch, policy = cfg.train.global_batch_size, cfg.activation_checkpointing.policy
    return [f"model_flops_per_step: {model_flops_per_step(spec, batch):.4g}  # {model_flops_per_token(spec):.4g} "
            f"per token x {batch} x {spec.seq_len} tokens (the trainer's MFU counts these)",
            f"hardware_flops_per_step: {hardware_flops_per_step(spec, batch, policy):.4g}  # the model's and what "
            f"activation_checkpointing.policy={policy} recomputes"]


def memory_prediction(cfg: Config) -> list[str]:
    """The planner's memory per GPU for each pipeline stage of resolved `cfg` (on a GPU: flash
    attention, fused kernels), as comment lines; a line saying why when it cannot plan the run."""
    head = ["", "# predicted memory per GPU and pipeline stage (megazero.planner; MiB by kind, on a GPU)"]
    if cfg.model.spec is None:
        return head + ["#   no model.spec: nothing to plan"]
    try:
        plan, why = predicted_memory(cfg)
    except (PlanError, SpecError) as err:
        return head + [f"#   cannot plan this run: {err}"]
    if plan is None:
        return head + [f"#   cannot plan this run: {why}"]
    return head + [f"#   {line}" for line in memory_lines(plan)]


def experts_lines(cfg: Config, gpus_per_node: int = 8) -> list[str]:
    """For a Mixture-of-Experts model: how its experts split, and a warning when the layout breaks the
    per-node rule (the experts should spread evenly over a node's GPUs: num_experts a multiple of the
    GPUs per node), which unbalances the load."""
    if cfg.model.spec is None:
        return []
    try:
        moe = spec_of(cfg).moe
    except SpecError:
        return []
    if moe is None:
        return []
    ep = cfg.parallel.ep
    lines = ["", "# mixture of experts",
             f"#   {moe.num_experts} experts per MoE layer, top-{moe.top_k}, over parallel.ep={ep}: "
             f"{moe.num_experts // max(ep, 1)} per rank, replicated over dp / ep = {cfg.parallel.dp // max(ep, 1)} "
             f"expert-data-parallel ranks; capacity "
             + ("none (no dropping)" if moe.capacity_factor is None else f"{moe.capacity_factor} per sequence")]
    tp = cfg.parallel.tp
    expert_tp = tp if cfg.parallel.expert_tp is None else cfg.parallel.expert_tp
    if tp > 1:
        lines.append(f"#   parallel.expert_tp={expert_tp}: " + (f"each expert's ffn split over the {tp} TP ranks"
                                                               if expert_tp > 1 else "whole experts on every TP rank"))
    if moe.num_experts % gpus_per_node:
        lines.append(f"#   WARNING: model.moe.num_experts={moe.num_experts} is not a multiple of the {gpus_per_node} GPUs "
                     f"per node: a node's GPUs cannot hold equal shares of the experts, which unbalances the load; "
                     f"use a multiple of {gpus_per_node} experts")
    return lines


def explain(cfg: Config, world_size: Optional[int] = None, deepspeed_defaults: Sequence[str] = (),
            gpus_per_node: int = 8) -> str:
    """The resolved config as YAML, then the DeepSpeed defaults a DeepSpeed file got (lines from
    `deepspeed.defaults_applied`), the derived values and any not-supported-yet keys."""
    cfg = resolve(cfg, world_size)
    lines = [to_yaml(cfg).rstrip(), ""]
    if deepspeed_defaults:
        lines += ["# DeepSpeed defaults (keys the DeepSpeed file leaves unset take DeepSpeed's value)"]
        lines += [f"#   {line}" for line in deepspeed_defaults] + [""]
    lines += ["# derived"]
    d = derived_values(cfg)
    p, m, v = cfg.parallel.pp, d["micro_batches_per_flush"], cfg.pipeline.chunks
    cp = cfg.parallel.cp
    lines += [f"world_size: {d['world_size']}",
              f"dp_size: {d['dp_size']}  # world / (pp x tp" + (" x cp" if cp > 1 else "") + f") = {d['world_size']} / "
              f"({p} x {cfg.parallel.tp}" + (f" x {cp}" if cp > 1 else "") + ")"]
    if cp > 1:
        lines += [f"context_parallel: {cp} ranks per sequence, {cfg.parallel.cp_method}  # each holds "
                  f"{cfg.model.seq_len // cp if cfg.model.seq_len else 'seq_len / cp'} tokens (a head and a tail chunk); "
                  f"gradients averaged and ZeRO sharded over dp x cp = {d['dp_size'] * cp}"]
    lines += [f"micro_batches_per_flush: {m}  # = train.gradient_accumulation_steps",
              f"bubble_fraction: {d['bubble_fraction']}  # {cfg.pipeline.schedule}, p={p}, m={m}, v={v}"]
    lines += flops_lines(cfg)
    lines += memory_prediction(cfg)
    lines += experts_lines(cfg, gpus_per_node)
    missing = unsupported(cfg)
    if missing:
        lines += ["", "# not supported yet (the trainer refuses these)"] + [f"#   {line}" for line in missing]
    return "\n".join(lines) + "\n"
