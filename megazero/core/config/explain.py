"""`bubble_fraction` (closed-form pipeline bubble) and `explain` (resolved config + derived values).

The closed forms follow REFERENCE.md, as fractions of the whole step (idle / (work + idle)) with
t_F = t_B = t_W and micro-batches m:

- gpipe, 1f1b:  (p-1) / (m + p-1)
- interleaved:  idle shrinks v-fold: ((p-1)/v) / (m + (p-1)/v) = (p-1) / (v*m + p-1)
- zb-h1:        idle is a third of 1F1B's ((p-1)(t_F+t_B-t_W) vs (p-1)(t_F+t_B+t_W)) while the
                work stays 3m units: (p-1) / (3m + p-1)

The pipeline simulator will measure these from the schedules themselves and replace this function.
"""
from __future__ import annotations

from typing import Optional

from .errors import ConfigError
from .schema import SCHEDULE_CHOICES, Config
from .supported import unsupported
from .tree import to_yaml
from .validate import resolve


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a pipeline step for `schedule` with p stages, m micro-batches, v chunks.

    Raises:
        ConfigError: unknown schedule name (a .csv schedule has no closed form) or sizes < 1.
    """
    for name, value in (("p", p), ("m", m), ("v", v)):
        if value < 1:
            raise ConfigError(f"bubble_fraction: {name} must be >= 1, got {value}")
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    raise ConfigError(f"pipeline.schedule: no closed-form bubble for {schedule!r} "
                      f"(known: {', '.join(SCHEDULE_CHOICES)}); simulate a .csv schedule instead")


def derived_values(cfg: Config) -> dict[str, object]:
    """The numbers `explain` prints for a resolved config."""
    pl, p = cfg.pipeline, cfg.parallel.pp
    m = cfg.train.gradient_accumulation_steps
    world = p * cfg.parallel.tp * cfg.parallel.dp
    if pl.schedule.endswith(".csv"):
        bubble: object = f"n/a (custom schedule {pl.schedule}: simulate it)"
    else:
        bubble = round(bubble_fraction(pl.schedule, p, m, pl.chunks), 6)
    return {"world_size": world, "dp_size": cfg.parallel.dp, "micro_batches_per_flush": m,
            "pipeline_schedule": pl.schedule, "bubble_fraction": bubble}


def explain(cfg: Config, world_size: Optional[int] = None) -> str:
    """The resolved config as YAML, then the derived values and any not-supported-yet keys."""
    cfg = resolve(cfg, world_size)
    lines = [to_yaml(cfg).rstrip(), "", "# derived"]
    d = derived_values(cfg)
    p, m, v = cfg.parallel.pp, d["micro_batches_per_flush"], cfg.pipeline.chunks
    lines += [f"world_size: {d['world_size']}",
              f"dp_size: {d['dp_size']}  # world / (pp x tp) = {d['world_size']} / ({p} x {cfg.parallel.tp})",
              f"micro_batches_per_flush: {m}  # = train.gradient_accumulation_steps",
              f"bubble_fraction: {d['bubble_fraction']}  # {cfg.pipeline.schedule}, p={p}, m={m}, v={v}"]
    missing = unsupported(cfg)
    if missing:
        lines += ["", "# not supported yet (the trainer refuses these)"] + [f"#   {line}" for line in missing]
    return "\n".join(lines) + "\n"
