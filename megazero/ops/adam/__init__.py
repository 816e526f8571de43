"""`deepspeed.ops.adam` as `megazero.ops.adam` (`megazero.compat.deepspeed_adam`)."""
from megazero.compat.deepspeed_adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]
