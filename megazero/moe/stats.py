"""One step's load-balance statistics of a model's MoE layers, agreed over the world group.

`step_stats(module, world_group, tp_size, num_layers, num_experts)` pops every local `MoELayer`'s sums (the
micro-batches trained since the last call), adds them per global layer over all ranks (one all-reduce
of a (layers, 4 + E) fp64 tensor) and returns, over the step's trained tokens:

- ``aux_loss``, ``z_loss``: the mean per-sequence losses (coefficients not applied);
- ``dropped``: the fraction of the top-k assignments dropped past capacity;
- ``imbalance``: the busiest expert's kept assignments over the mean, worst layer (1 = balanced);
- ``tokens_per_expert``: kept assignments per expert, summed over layers.

TP ranks route the same tokens, so their sums are divided by the TP size.
"""
from __future__ import annotations

import torch

from megazero.moe.layer import MoELayer
from megazero.runtime import comm


def step_stats(module, world_group, tp_size: int, num_layers: int, num_experts: int, device=None) -> dict | None:
    """The step's statistics (module docstring) of a model whose MoE layers have `num_experts` experts,
    or None when no layer trained. Collective over `world_group`: every rank calls (a stage without MoE
    layers too), on `device` (the accelerator under NCCL; default CPU)."""
    table = torch.zeros(num_layers, 4 + num_experts, dtype=torch.float64, device=device)
    for m in (m for m in module.modules() if isinstance(m, MoELayer)):
        table[int(m.name.split(".")[1])] += m.stats.pop().to(device)  # layers.<i>.mlp
    comm.all_reduce(table, world_group)
    table = table.cpu() / tp_size
    used = table[:, 3] > 0
    if not used.any():
        return None
    t = table[used]
    micro = t[:, 3].sum()
    tokens = t[:, 4:]
    assignments = tokens.sum() + t[:, 2].sum()
    imbalance = (tokens.max(1).values / tokens.mean(1).clamp_min(1e-12)).max()
    return {"aux_loss": float(t[:, 0].sum() / micro), "z_loss": float(t[:, 1].sum() / micro),
            "dropped": float(t[:, 2].sum() / assignments) if assignments else 0.0,
            "imbalance": float(imbalance), "tokens_per_expert": [int(v) for v in tokens.sum(0).tolist()]}


__all__ = ["step_stats"]
