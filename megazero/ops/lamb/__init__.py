"""DeepSpeed's `deepspeed.ops.lamb` import path (`megazero.compat.lamb`): refused by name."""
from megazero.compat.lamb import FusedLamb

__all__ = ["FusedLamb"]
