"""DeepSpeed's `deepspeed.runtime.pipe.topology` import path (`megazero.compat.pipe_topology`)."""
from megazero.compat.pipe_topology import (PipeDataParallelTopology, PipelineParallelGrid,
                                           PipeModelDataParallelTopology, ProcessTopology)

__all__ = ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid"]
