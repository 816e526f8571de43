"""DeepSpeed's `deepspeed.ops` import path: `megazero.ops.adam` (FusedAdam, DeepSpeedCPUAdam, defined in `megazero.ops.deepspeed_adam`)."""
