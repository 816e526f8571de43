"""DeepSpeed's `deepspeed.runtime.zero.stage3` import path: the ZeRO-3 memory estimators."""
from megazero.compat.zero_estimators import (estimate_zero3_model_states_mem_needs,
                                             estimate_zero3_model_states_mem_needs_all_cold,
                                             estimate_zero3_model_states_mem_needs_all_live)

__all__ = ["estimate_zero3_model_states_mem_needs", "estimate_zero3_model_states_mem_needs_all_cold",
           "estimate_zero3_model_states_mem_needs_all_live"]
