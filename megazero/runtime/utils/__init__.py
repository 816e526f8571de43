"""DeepSpeed's `deepspeed.runtime.utils` import path: `set_random_seed` (`megazero.runtime.seeding`) and
`see_memory_usage` (`megazero.compat.helpers`)."""
from megazero.compat.helpers import see_memory_usage
from megazero.runtime.seeding import set_random_seed

__all__ = ["set_random_seed", "see_memory_usage"]
