"""DeepSpeed's `deepspeed.utils` import path: `RepeatingLoader` (`megazero.data.repeating`), the
logger and `log_dist` (`megazero.compat.helpers`)."""
from megazero.compat.helpers import log_dist, logger, print_dist, set_log_level_from_string
from megazero.data.repeating import RepeatingLoader

__all__ = ["RepeatingLoader", "logger", "log_dist", "print_dist", "set_log_level_from_string"]
