"""DeepSpeed's names that megazero's own layers have no use for, kept thin and in one place: the
accelerator abstraction, the `deepspeed.comm` wrapper with its comms logger, the activation-
checkpointing API, the pipeline topology and grid, the `utils` helpers. The DeepSpeed import paths
(`megazero.accelerator`, `megazero.comm`, `megazero.checkpointing`, `megazero.runtime.pipe`, ...)
re-export from here; everything trains through the one engine (`megazero.engine`)."""
