"""Loss scaling for fp16: static, or dynamic with DeepSpeed's semantics.

Dynamic: start at 2**initial_scale_power; on an overflowing step, use up one unit of hysteresis or,
when none is left, halve the scale (never below min_loss_scale); after `loss_scale_window`
consecutive steps without overflow, double it. Whether a step overflowed is decided by the caller
over every rank (dp x tp x pp), so every rank skips the same step and keeps the same scale.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScaler:
    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    factor: float = 2.0

    def __post_init__(self):
        self._hysteresis_left = self.hysteresis
        self._good_steps = 0

    @classmethod
    def static(cls, scale: float = 1.0) -> "LossScaler":
        return cls(scale=float(scale), dynamic=False)

    @classmethod
    def dynamic_from(cls, initial_scale_power: int = 16, loss_scale_window: int = 1000, hysteresis: int = 2,
                     min_loss_scale: float = 1.0) -> "LossScaler":
        return cls(scale=2.0 ** initial_scale_power, dynamic=True, window=loss_scale_window,
                   hysteresis=hysteresis, min_scale=float(min_loss_scale))

    def update(self, overflow: bool) -> None:
        """Adjust the scale after a step that did (True) or did not overflow."""
        if not self.dynamic:
            return
        if overflow:
            self._good_steps = 0
            if self._hysteresis_left > 1:
                self._hysteresis_left -= 1
            else:
                self.scale = max(self.scale / self.factor, self.min_scale)
            return
        self._good_steps += 1
        if self._good_steps % self.window == 0:
            self.scale *= self.factor
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left, "good_steps": self._good_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self._hysteresis_left, self._good_steps = sd["scale"], sd["hysteresis_left"], sd["good_steps"]
