"""DeepSpeed's `deepspeed.checkpointing` import path (`megazero.compat.activation_api`): activation
checkpointing as Megatron-style models call it."""
from megazero.compat.activation_api import (CudaRNGStatesTracker, checkpoint, configure, get_cuda_rng_tracker,
                                            is_configured, model_parallel_cuda_manual_seed,
                                            model_parallel_reconfigure_tp_seed, non_reentrant_checkpoint, reset,
                                            set_num_layers)

__all__ = ["configure", "is_configured", "reset", "set_num_layers", "checkpoint", "non_reentrant_checkpoint",
           "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed",
           "CudaRNGStatesTracker"]
