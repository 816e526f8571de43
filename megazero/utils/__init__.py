"""DeepSpeed's `deepspeed.utils` import path: `RepeatingLoader` (`megazero.data.repeating`), the
logger and `log_dist` (`megazero.compat.helpers`), the per-parameter views of the optimizer's state
(`safe_get_*` / `safe_set_*`, `megazero.compat.tensor_fragment`), and `zero_to_fp32`."""
from megazero.compat.helpers import log_dist, logger, print_dist, set_log_level_from_string
from megazero.compat.tensor_fragment import (safe_get_full_fp32_param, safe_get_full_grad,
                                             safe_get_full_optimizer_state, safe_get_local_fp32_param,
                                             safe_get_local_grad, safe_get_local_optimizer_state,
                                             safe_set_full_fp32_param, safe_set_full_grad,
                                             safe_set_full_optimizer_state, safe_set_local_fp32_param,
                                             safe_set_local_grad, safe_set_local_optimizer_state)
from megazero.data.repeating import RepeatingLoader

__all__ = ["RepeatingLoader", "logger", "log_dist", "print_dist", "set_log_level_from_string",
           "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state"]
