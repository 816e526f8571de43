"""DeepSpeed's `deepspeed.utils` import path: `RepeatingLoader` (defined in `megazero.data.repeating`)."""
from megazero.data.repeating import RepeatingLoader

__all__ = ["RepeatingLoader"]
