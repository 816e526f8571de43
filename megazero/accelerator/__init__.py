"""DeepSpeed's `deepspeed.accelerator` import path (`megazero.compat.accelerator`)."""
from megazero.compat.accelerator import (CpuAccelerator, CudaAccelerator, get_accelerator,
                                         is_current_accelerator_supported, set_accelerator)

__all__ = ["get_accelerator", "set_accelerator", "is_current_accelerator_supported", "CudaAccelerator",
           "CpuAccelerator"]
