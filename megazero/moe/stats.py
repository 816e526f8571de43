"""One step's load-balance statistics of a model's MoE layers, agreed over the world group.

`step_stats(module, world_group, tp_size, num_layers, num_experts)` pops every local `MoELayer`'s sums (the
micro-batches trained since the last call), adds them per global layer over all ranks (one all-reduce
of a (layers, 4 + E) fp64 tensor) and returns, over the step's trained tokens:

- ``aux_loss``, ``z_loss``: the mean per-sequence losses (coefficients not applied);
- ``dropped``: the fraction of the top-k assignments dropped past capacity;
- ``imbalance``: the busiest expert's kept assignments over the mean, worst layer (1 = balanced);
- ``tokens_per_expert``: kept assignments per expert, summed over layers.

TP ranks route the same tokens, so their sums are divided by the TP size.

No host synchronisation: everything is computed on the device into one fp64 vector, a `MoEStepStats`:
a read-only mapping with the keys above that copies the vector to the host the first time it is read
(one `.tolist()`), which the trainer does when it writes the step's metrics (`megazero.run.metrics.
MetricsWriter` serialises any mapping as a dict), not when the step ends.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from megazero.moe.layer import MoELayer
from megazero.runtime import comm

KEYS = ("aux_loss", "z_loss", "dropped", "imbalance", "tokens_per_expert")


class MoEStepStats(Mapping):
    """A step's statistics (module docstring) still on the device: `vector`, fp64 [aux_loss, z_loss,
    dropped, imbalance, tokens per expert...]. Read as a mapping (`KEYS`) it is copied to the host once
    (`as_dict`: one `.tolist()`, a host synchronisation) and kept."""

    def __init__(self, vector: torch.Tensor):
        self.vector = vector
        self._values: dict | None = None

    def as_dict(self) -> dict:
        """The statistics as Python numbers (tokens per expert as ints); the first call waits for the device."""
        if self._values is None:
            v = self.vector.tolist()
            self._values = dict(zip(KEYS[:4], v[:4])) | {"tokens_per_expert": [int(n) for n in v[4:]]}
        return dict(self._values)

    def __getitem__(self, key: str):
        return self.as_dict()[key]

    def __iter__(self):
        return iter(KEYS)

    def __len__(self) -> int:
        return len(KEYS)

    def __repr__(self) -> str:
        return f"MoEStepStats({self.as_dict() if self._values is not None else 'on the device'})"


def step_stats(module, world_group, tp_size: int, num_layers: int, num_experts: int,
               device=None) -> MoEStepStats:
    """The step's statistics (module docstring) of a model whose MoE layers have `num_experts` experts,
    on the device (a step in which no MoE layer trained, which `train_batch` never makes, reads as
    zeros). Collective over `world_group`: every rank calls (a stage without MoE layers too), on
    `device` (the accelerator under NCCL; default CPU). No host synchronisation."""
    table = torch.zeros(num_layers, 4 + num_experts, dtype=torch.float64, device=device)
    for m in (m for m in module.modules() if isinstance(m, MoELayer)):
        sums = m.stats.pop()
        if sums is not None:
            table[int(m.name.split(".")[1])] += sums.to(device)  # layers.<i>.mlp
    comm.all_reduce(table, world_group)
    t = table / tp_size  # (layers, 4 + E): [aux, z, dropped, micro-batches, tokens...]; untrained layers all 0
    micro = t[:, 3].sum().clamp_min(1)
    tokens = t[:, 4:]  # (layers, E)
    assignments = (tokens.sum() + t[:, 2].sum()).clamp_min(1)
    imbalance = (tokens.max(1).values / tokens.mean(1).clamp_min(1e-12)).max()  # an untrained layer's: 0
    head = torch.stack([t[:, 0].sum() / micro, t[:, 1].sum() / micro, t[:, 2].sum() / assignments, imbalance])
    return MoEStepStats(torch.cat([head, tokens.sum(0)]))


__all__ = ["MoEStepStats", "step_stats"]
