"""DeepSpeed's `deepspeed.runtime.pipe` import path: PipelineModule, LayerSpec, TiedLayerSpec
(`megazero.pipeline.pipeline_module`) and the topologies (`megazero.runtime.pipe.topology`)."""
from megazero.compat.pipe_topology import (PipeDataParallelTopology, PipelineParallelGrid,
                                           PipeModelDataParallelTopology, ProcessTopology)
from megazero.pipeline.pipeline_module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology", "PipeDataParallelTopology",
           "PipeModelDataParallelTopology", "PipelineParallelGrid"]
