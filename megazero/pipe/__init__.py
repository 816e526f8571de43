"""DeepSpeed's `deepspeed.pipe` import path: PipelineModule, LayerSpec, TiedLayerSpec."""
from megazero.pipeline.pipeline_module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec"]
