"""A run's config checked against its model spec, its schedule and its nodes, while it loads (L0: no torch).

`load_for_run` is what a run loads its config with (`megazero.engine.load_run_config` passes it the
launcher's world sizes): `load_config` / `resolve` and the schema's checks, then the features not
supported yet (`assert_supported`), the model spec against the layout (`check_model_and_schedule`) and
ZeRO++'s hpZ groups against the nodes (`check_hpz_in_a_node`). Every refusal here needs only the config,
the model spec and the launcher's sizes, so all of them come before any process group exists; what the
engine builds afterwards is not checked again.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from ..instructions import ScheduleError
from ..moe_spec import MoESpecError
from ..schedules import get_schedule
from ..spec import spec_of
from ..spec_partition import layer_kinds, partition_problems, spec_bounds
from .errors import ConfigError
from .loading import load_config
from .schema import Config
from .supported import assert_supported
from .validate import resolve, topology_of


def load_for_run(config, overrides: Sequence[str] = (), world_size: Optional[int] = None,
                 local_world_size: int = 1) -> Config:
    """The resolved Config of a path, dict or Config plus ``key=value`` `overrides` for a run of
    `world_size` ranks, `local_world_size` of them per node (the launcher's; ``parallel.ranks_per_node``
    overrides it), with every refusal of this module raised (module docstring)."""
    if isinstance(config, Config):
        if overrides:
            raise ConfigError(f"overrides {list(overrides)}: a Config is used as it is; apply key=value overrides "
                              f"to a config file or dict, or change the Config with dataclasses.replace")
        cfg = resolve(config, world_size)
    else:
        cfg = load_config(config, list(overrides), world_size=world_size)
    assert_supported(cfg)
    check_model_and_schedule(cfg)
    check_hpz_in_a_node(cfg, local_world_size)
    return cfg


def with_spec(cfg: Config, ref: str) -> Config:
    """`cfg` with ``model.spec`` = `ref` (a spec named to `initialize` rather than in the config), checked
    as `load_for_run` checks the config's own."""
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, spec=ref))
    check_model_and_schedule(cfg)
    return cfg


def check_model_and_schedule(cfg: Config) -> None:
    """What building the model and the engine will need: the spec loads and splits over the TP group,
    ``pipeline.partition`` splits its layers (the planner's `Layout` asks the same functions), and the
    schedule builds for (pp, micro-batches, chunks).

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
    and a method's split of the L + 2 pipeline layers (every virtual stage needs one). The layers' parameter
    counts decide where a balanced split falls, not whether it exists (any positive counts: the same
    refusals), so each layer counts 1 here and the build passes the real ones."""
    parts, part = cfg.parallel.pp * cfg.pipeline.chunks, cfg.pipeline.partition
    errs = partition_problems(part, parts, spec.layers)
    if not errs:
        try:
            spec_bounds(spec, cfg.parallel.pp, cfg.pipeline.chunks, part, dict.fromkeys(layer_kinds(spec), 1))
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


def check_hpz_in_a_node(cfg: Config, local_world_size: int) -> None:
    """ZeRO++'s hpZ groups (runs of zero.hpz_partition_size consecutive dp ranks) must each sit in one node
    (``parallel.ranks_per_node`` ranks, else the launcher's `local_world_size`), or the secondary partition
    costs memory and saves no inter-node byte."""
    k = cfg.zero.hpz_partition_size
    if k <= 1:
        return
    per_node = cfg.parallel.ranks_per_node or local_world_size
    for run in topology_of(cfg).data_parallel_runs(k):
        if len({r // per_node for r in run}) > 1:
            stride = run[1] - run[0]  # consecutive dp ranks this far apart (tp, or pp x tp in another order)
            raise ConfigError(f"zero.hpz_partition_size={k}: its groups span nodes of {per_node} ranks (dp ranks are "
                              f"{stride} ranks apart); use at most {max(1, per_node // stride)}, the dp ranks of one "
                              f"node, or set parallel.ranks_per_node")
