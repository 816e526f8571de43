"""DeepSpeed's `deepspeed.ops` import path: `megazero.ops.adam` (FusedAdam, DeepSpeedCPUAdam, defined in `megazero.compat.deepspeed_adam`)."""
from megazero.ops import adam  # noqa: E402  (deepspeed.ops.adam is reachable as an attribute too)
from megazero.ops import lamb  # noqa: E402  (refused by name: megazero has no LAMB)

__all__ = ["adam", "lamb"]
