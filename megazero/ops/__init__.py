"""DeepSpeed's `deepspeed.ops` import path: `megazero.ops.adam` (FusedAdam, DeepSpeedCPUAdam, defined in `megazero.ops.deepspeed_adam`)."""
from megazero.ops import adam  # noqa: E402  (deepspeed.ops.adam is reachable as an attribute too)

__all__ = ["adam"]
