"""DeepSpeed's `deepspeed.profiling` import path (the flops profiler)."""
