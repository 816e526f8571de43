"""DeepSpeed's `deepspeed.profiling` import path (the flops profiler)."""
from megazero.profiling import flops_profiler  # noqa: F401  (deepspeed.profiling.flops_profiler as an attribute)
