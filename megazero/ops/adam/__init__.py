"""`deepspeed.ops.adam` as `megazero.ops.adam` (see `megazero.ops.deepspeed_adam`)."""
from megazero.ops.deepspeed_adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]
