"""DeepSpeed's `deepspeed.profiling.flops_profiler` import path (`megazero.compat.flops_profiler`)."""
from megazero.compat.flops_profiler import FlopsProfiler, get_model_profile

__all__ = ["FlopsProfiler", "get_model_profile"]
