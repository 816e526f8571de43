"""Learning-rate schedules as pure functions of the step, and a scheduler that applies them.

Types: constant; linear and cosine (linear warmup from warmup_min_lr to lr over warmup_steps, then
decay to min_lr at total_steps); DeepSpeed's WarmupLR (warmup then constant) and WarmupDecayLR
(warmup then linear decay to min_lr).
"""
from __future__ import annotations

import math
import warnings

from megazero.core.config.schema import SCHEDULER_CHOICES

VALID = SCHEDULER_CHOICES  # one list: the config schema's


def lr_at(step: int, kind: str, lr: float, warmup_steps: int = 0, total_steps: int = 0,
          min_lr: float = 0.0, warmup_min_lr: float = 0.0, warmup_type: str = "linear") -> float:
    """Learning rate for optimizer step `step` (0-based: the first update uses step 0). Warmup is
    linear, or logarithmic (DeepSpeed's WarmupLR default: log(step+1)/log(warmup_steps))."""
    if kind not in VALID:
        raise ValueError(f"scheduler.type {kind!r} is not one of {', '.join(VALID)}")
    if warmup_type not in ("linear", "log"):
        raise ValueError(f"scheduler.warmup_type {warmup_type!r} is not one of linear, log")
    if kind == "constant":
        return lr
    if warmup_steps > 0 and step < warmup_steps:
        if warmup_type == "log":
            frac = math.log(step + 1) / math.log(warmup_steps) if warmup_steps > 1 else 1.0
        else:
            frac = (step + 1) / warmup_steps
        return warmup_min_lr + (lr - warmup_min_lr) * frac
    if kind == "WarmupLR":
        return lr
    span = max(1, total_steps - warmup_steps)
    frac = min(1.0, max(0.0, (step - warmup_steps) / span))
    if kind in ("linear", "WarmupDecayLR"):
        return min_lr + (lr - min_lr) * (1.0 - frac)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * frac))


class LRScheduler:
    """Sets `optimizer.param_groups[*]["lr"]` from `lr_at` each time `step()` is called."""

    def __init__(self, optimizer, kind: str = "constant", lr: float | None = None, warmup_steps: int = 0,
                 total_steps: int = 0, min_lr: float = 0.0, warmup_min_lr: float = 0.0,
                 warmup_type: str = "linear"):
        self.optimizer = optimizer
        self.kwargs = dict(kind=kind, lr=lr if lr is not None else optimizer.param_groups[0]["lr"],
                           warmup_steps=warmup_steps, total_steps=total_steps, min_lr=min_lr,
                           warmup_min_lr=warmup_min_lr, warmup_type=warmup_type)
        lr_at(0, **self.kwargs)  # validates the kind
        self.last_step = 0
        self._apply()

    def _apply(self) -> None:
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr_at(self.last_step, **self.kwargs)

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [param_group["lr"] for param_group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_step": self.last_step}

    def load_state_dict(self, sd: dict) -> None:
        self.last_step = sd["last_step"]
        self._apply()


def step_lr_scheduler(scheduler) -> None:
    """`scheduler.step()` after an optimizer step. A torch scheduler built on a client optimizer that
    the ZeRO optimizer took over (they share the parameter-group dicts) cannot see the ZeRO step, so
    torch's check of the call order would warn wrongly; that one warning is silenced here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        warnings.filterwarnings("ignore", message=r"Seems like `optimizer\.step\(\)` has been overridden")
        scheduler.step()
