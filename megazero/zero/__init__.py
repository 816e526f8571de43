"""ZeRO data parallelism (L2): the optimizer that shards model states over the dp group.

- `optimizer`: `ZeroOptimizer` (stages 0-3, CPU offload, clipping, the step) and `OptimizerSpec`;
- `param_groups`: the rules of a parameter group, Megatron's decay split, the hyper-parameters kept
  in checkpoints, and which ranges of the flat buffers each group updates;
- `flat_group`: `FlatGroup`, one flat fp32 gradient buffer with its buckets, shards and master;
- `stage3`: `Stage3Gatherer`, ZeRO-3's per-layer parameter gathering;
- `unit_ends`: `UnitEnds`, where stages 2-3 launch their reductions when the graph depends on the data;
- `loss_scaler`, `lr_schedule`: the loss scale and the learning-rate schedule.

- `partitioned_init`: DeepSpeed's `Init` (build a model partitioned over the ranks) and `GatheredParameters`,
  reachable as `megazero.zero.Init` / `megazero.zero.GatheredParameters` as in DeepSpeed; with
  `register_external_parameter` (`stage3`) and `TiledLinear` (`tiled_linear`), DeepSpeed's `deepspeed.zero`.

The shard and bucket index arithmetic is pure and lives in `megazero.core.flat_buffer`. Import the
other submodules directly.
"""
from megazero.zero.partitioned_init import GatheredParameters, Init
from megazero.zero.stage3 import register_external_parameter, unregister_external_parameter
from megazero.zero.tiled_linear import TiledLinear

__all__ = ["Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter",
           "TiledLinear"]
