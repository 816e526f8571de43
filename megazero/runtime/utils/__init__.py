"""DeepSpeed's `deepspeed.runtime.utils` import path: `set_random_seed` (`megazero.runtime.seeding`)."""
from megazero.runtime.seeding import set_random_seed

__all__ = ["set_random_seed"]
