"""Pipeline parallelism at run time (L2): the parts that move tensors between stages.

- `pipeline_module`: `PipelineModule`, `LayerSpec`, `TiedLayerSpec` (a layer list of which each rank
  builds only its own stage's layers);
- `p2p`: activations and their gradients between neighbouring stages over the pp group;
- `executor`: walks one stage's program (a schedule from `megazero.core.schedules`) instruction by
  instruction; its two partners, the stage and the optimizer, are `typing.Protocol`s there.

The pure parts (instructions, schedules, simulator, partition) live in `megazero.core`.
"""
