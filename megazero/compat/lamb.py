"""DeepSpeed's `deepspeed.ops.lamb`, refused: megazero's ZeRO optimizer implements Adam, AdamW, SGD and
1-bit Adam (its update runs on the flat fp32 shards; LAMB's per-layer trust ratio would need each
parameter's whole norm across the shards, which it does not compute)."""


class FusedLamb:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("deepspeed.ops.lamb.FusedLamb: megazero has no LAMB (its ZeRO optimizer runs Adam, "
                                  "AdamW, SGD and 1-bit Adam on flat shards, without the per-layer norms LAMB's trust "
                                  "ratio needs); use megazero.ops.adam.FusedAdam or torch.optim.AdamW")


__all__ = ["FusedLamb"]
