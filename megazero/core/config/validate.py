"""`validate` (every check, before any process group exists) and `resolve` (fill derived fields).

The layout rule: parallel.pp x parallel.cp x parallel.tp x parallel.dp = world size (dp derived when unset).
The batch rule: train.global_batch_size = train.micro_batch_size x train.gradient_accumulation_steps
x dp, where dp is the data-parallel size (world / (pp x cp x tp)), not the world size: the cp ranks of a
data-parallel rank hold different tokens of the same sequences.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..schedules import SCHEDULES
from ..topology import Topology
from .checks import ALL_CHECKS, schedule_sizes
from .errors import ConfigError
from .schema import Config

_MB, _GAS, _GB = "train.micro_batch_size", "train.gradient_accumulation_steps", "train.global_batch_size"


def topology_of(cfg: Config) -> Topology:
    """The rank grid of a resolved config: pp x dp x cp x tp in ``parallel.order``, cp (when the order does not
    name it) just outside tp, as Megatron-Core lays it out."""
    p = cfg.parallel
    axes = tuple(p.order)
    if p.cp > 1 and "cp" not in axes:
        axes = axes[:axes.index("tp")] + ("cp",) + axes[axes.index("tp"):]
    return Topology(pp=p.pp, dp=p.dp, tp=p.tp, cp=p.cp, order=axes)


def layout_dp(cfg: Config, world_size: Optional[int]) -> Optional[int]:
    """The data-parallel size: parallel.dp, or world_size / (pp * cp * tp). None when neither is known.

    Raises ConfigError when the grid does not tile `world_size`.
    """
    pp, tp, dp, cp = cfg.parallel.pp, cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.cp
    if world_size is None:
        return dp
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size: must be a positive integer, got {world_size!r}")
    names = "parallel.pp x parallel.tp" + (" x parallel.cp" if cp > 1 else "")
    sizes = f"{pp} x {tp}" + (f" x {cp}" if cp > 1 else "")
    if dp is None:
        if world_size % (pp * tp * cp):
            raise ConfigError(f"{names} = {sizes} = {pp * tp * cp} does not divide world size {world_size}; "
                              f"choose sizes whose product divides it")
        return world_size // (pp * tp * cp)
    if pp * tp * cp * dp != world_size:
        raise ConfigError(f"{names} x parallel.dp = {sizes} x {dp} = {pp * tp * cp * dp} "
                          f"!= world size {world_size}; leave parallel.dp unset to derive it")
    return dp


def derive_batch(micro: Optional[int], gas: Optional[int], global_: Optional[int],
                 dp: int) -> tuple[int, int, int]:
    """Complete the batch triple so that global = micro * gas * dp.

    Any two given derive the third; only the global batch gives gas = 1; only micro or only gas
    sets the other to 1; none gives micro = gas = 1.

    Returns:
        (micro_batch_size, gradient_accumulation_steps, global_batch_size).

    Raises:
        ConfigError naming the keys and numbers when they are inconsistent or do not divide.
    """
    if global_ is None:
        micro, gas = micro or 1, gas or 1
        return micro, gas, micro * gas * dp
    if micro is not None and gas is not None:
        if micro * gas * dp != global_:
            raise ConfigError(f"{_GB}: {global_} != {_MB} x {_GAS} x dp = {micro} x {gas} x {dp} = "
                              f"{micro * gas * dp}; set at most two of the three")
        return micro, gas, global_
    if micro is None and gas is None:
        gas = 1
    if micro is None:
        if global_ % (gas * dp):
            raise ConfigError(f"{_GB}: {global_} is not divisible by {_GAS} x dp = {gas} x {dp} = {gas * dp}")
        return global_ // (gas * dp), gas, global_
    if global_ % (micro * dp):
        raise ConfigError(f"{_GB}: {global_} is not divisible by {_MB} x dp = {micro} x {dp} = {micro * dp}")
    return micro, global_ // (micro * dp), global_


def _derived_checks(cfg: Config, world_size: Optional[int]) -> tuple[list[str], Optional[int]]:
    """Layout and batch-rule messages, and dp if known (skipped while sizes are already invalid)."""
    t, par = cfg.train, cfg.parallel
    sizes = (par.pp, par.tp, par.dp, t.micro_batch_size, t.gradient_accumulation_steps, t.global_batch_size)
    if any(v is not None and v < 1 for v in sizes):
        return [], None  # check_parallel / check_train already name these
    try:
        dp = layout_dp(cfg, world_size)
    except ConfigError as e:
        return [str(e)], None
    if dp is None or dp < 1:
        return [], None
    rpn = par.ranks_per_node
    if world_size is not None and isinstance(rpn, int) and rpn >= 1 and world_size % rpn:
        return [f"parallel.ranks_per_node={rpn} does not divide the world size {world_size}: nodes hold the same "
                f"number of consecutive ranks"], dp
    hpz = cfg.zero.hpz_partition_size
    if isinstance(hpz, int) and hpz >= 1 and dp % hpz:
        return [f"zero.hpz_partition_size={hpz} does not divide the data-parallel size dp={dp}: the secondary "
                f"partition is over runs of that many dp ranks"], dp
    if isinstance(par.ep, int) and par.ep >= 1 and dp % par.ep:
        return [f"parallel.ep={par.ep} does not divide the data-parallel size dp={dp}: experts are split over ep "
                f"of the dp ranks; use an ep that divides {dp}"], dp
    try:
        _, gas, _ = derive_batch(t.micro_batch_size, t.gradient_accumulation_steps, t.global_batch_size, dp)
    except ConfigError as e:
        return [str(e)], dp
    pl = cfg.pipeline
    if pl.schedule in SCHEDULES and not schedule_sizes(pl.schedule, par.pp, None, pl.chunks):
        return schedule_sizes(pl.schedule, par.pp, gas, pl.chunks), dp  # the m rules (check_pipeline has the rest)
    return [], dp


def validate(cfg: Config, world_size: Optional[int] = None) -> None:
    """Check every field and cross-field rule; raise one ConfigError listing every problem.

    Args:
        cfg: a config (resolved or not).
        world_size: number of ranks. None skips the world-size rules unless parallel.dp is set,
            in which case the world is taken to be pp * tp * dp.
    """
    if not isinstance(cfg, Config):
        raise ConfigError(f"config: expected a megazero Config dataclass, got {type(cfg).__name__}")
    errors: list[str] = []
    for check in ALL_CHECKS:
        errors += check(cfg)
    derived, _ = _derived_checks(cfg, world_size)
    errors += derived
    if errors:
        raise ConfigError("\n".join(errors))


def _resolved_buckets(cfg: Config) -> dict[str, int]:
    """ZeRO sizes left as None by DeepSpeed "auto": from model.hidden (HF formulas) or DeepSpeed defaults."""
    h = cfg.model.hidden
    z = cfg.zero
    auto = {"reduce_bucket_size": h * h if h else 500_000_000,
            "allgather_bucket_size": h * h if h else 500_000_000,
            "prefetch_bucket_size": int(0.9 * h * h) if h else 50_000_000,
            "param_persistence_threshold": 10 * h if h else 100_000}
    return {k: v for k, v in auto.items() if getattr(z, k) is None}


def resolve(cfg: Config, world_size: Optional[int] = None) -> Config:
    """A copy of `cfg` with every derived field filled; validates first.

    Fills parallel.dp, the batch triple, ZeRO "auto" sizes and overlap_comm, optimizer.adamw_mode,
    scheduler.total_steps (= train.steps), name ("run"), run_dir (runs/<name>), checkpoint.dir
    (<run_dir>/checkpoints) and log.metrics_file (<run_dir>/metrics.jsonl). Idempotent.

    Raises:
        ConfigError: any validation problem, or dp unknown (no world_size and no parallel.dp).
    """
    validate(cfg, world_size)
    dp = layout_dp(cfg, world_size)
    if dp is None:
        raise ConfigError("parallel.dp: unknown; pass the world size (--world-size N) or set parallel.dp")
    t = cfg.train
    micro, gas, global_ = derive_batch(t.micro_batch_size, t.gradient_accumulation_steps, t.global_batch_size, dp)
    name = cfg.name or "run"
    run_dir = cfg.run_dir or f"runs/{name}"
    rep = dataclasses.replace
    z = cfg.zero
    return rep(
        cfg, name=name, run_dir=run_dir,
        parallel=rep(cfg.parallel, dp=dp),
        train=rep(t, micro_batch_size=micro, gradient_accumulation_steps=gas, global_batch_size=global_),
        zero=rep(z, overlap_comm=z.stage == 3 if z.overlap_comm is None else z.overlap_comm,
                 **_resolved_buckets(cfg)),
        optimizer=rep(cfg.optimizer, adamw_mode=(cfg.optimizer.type == "adamw" if cfg.optimizer.adamw_mode is None
                                                 else cfg.optimizer.adamw_mode)
                      if cfg.optimizer.type != "sgd" else None),
        scheduler=rep(cfg.scheduler, total_steps=cfg.scheduler.total_steps or t.steps),
        checkpoint=rep(cfg.checkpoint, dir=cfg.checkpoint.dir or f"{run_dir}/checkpoints"),
        log=rep(cfg.log, metrics_file=cfg.log.metrics_file or f"{run_dir}/metrics.jsonl"),
    )
