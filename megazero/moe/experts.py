"""The routed experts of one MoE layer held by one expert-parallel rank, run as a group.

Parameters are stacked over this rank's E/P experts: GeLU / ReLU ``fc1`` (E/P, f, h) and ``fc2`` (E/P, h, f);
SwiGLU ``gate`` and ``up`` (E/P, f, h) and ``down`` (E/P, h, f). Their logical tensors are (E, ...),
split over the ep group on dim 0 (``ep_dim = 0``); each expert's initial values depend only on the
seed and its global index, so every ep layout starts from the same model. Not tensor-parallel: every
TP rank of an ep rank holds the same experts (TP replicated).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazero.runtime import comm
from megazero.tensor_parallel.init import make_param


_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


def expert_param(local: int, num_experts: int, ep_rank: int, shape: tuple[int, int], name: str, seed: int,
                 std: float, device, dtype, routed: bool = True) -> nn.Parameter:
    """This ep rank's `local` experts of the logical (num_experts, *shape) parameter `name`; `routed`
    False for a shared expert (one, on every rank, a dense parameter)."""
    first = ep_rank * local
    each = [make_param(shape, logical_name=f"{name}[{e}]", full_shape=shape, tp_dim=None, tp_rank=0, tp_size=1,
                       init="normal", seed=seed, std=std, device=device, dtype=dtype).data
            for e in range(first, first + local)]  # expert e's values depend on (seed, name, e) only
    p = nn.Parameter(torch.stack(each))  # (local, *shape)
    p.logical_name, p.full_shape = name, (num_experts,) + tuple(shape)
    p.tp_dim, p.tp_rank, p.tp_size, p.sequence_parallel = None, 0, 1, False  # TP replicated
    if routed:
        p.ep_dim, p.ep_rank, p.ep_size = 0, ep_rank, num_experts // local
    p.expert = routed
    return p


class GroupedExperts(nn.Module):
    """Experts ``ep_rank·local .. (ep_rank+1)·local − 1`` of a layer (global names ``{name}.fc1`` ...);
    with `routed` False, the layer's shared expert (num_experts = local = 1, dense)."""

    def __init__(self, hidden: int, ffn: int, activation: str, num_experts: int, local: int, ep_rank: int,
                 name: str, seed: int, std: float, out_std: float, device=None, dtype=torch.float32,
                 routed: bool = True):
        super().__init__()
        self.activation, self.local = activation, local
        make = dict(local=local, num_experts=num_experts, ep_rank=ep_rank, seed=seed, device=device, dtype=dtype,
                    routed=routed)
        if activation == "swiglu":
            self.gate = expert_param(shape=(ffn, hidden), name=f"{name}.gate", std=std, **make)
            self.up = expert_param(shape=(ffn, hidden), name=f"{name}.up", std=std, **make)
            self.down = expert_param(shape=(hidden, ffn), name=f"{name}.down", std=out_std, **make)
        else:
            self.fc1 = expert_param(shape=(ffn, hidden), name=f"{name}.fc1", std=std, **make)
            self.fc2 = expert_param(shape=(hidden, ffn), name=f"{name}.fc2", std=out_std, **make)

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`rows` (N, h) grouped by local expert, `counts[e]` rows each; returns (N, h)."""
        outs = []
        for e, part in enumerate(rows.split(counts)):
            if self.activation == "swiglu":
                y = F.linear(F.silu(F.linear(part, self.gate[e])) * F.linear(part, self.up[e]), self.down[e])
            else:
                y = F.linear(_ACTIVATIONS[self.activation](F.linear(part, self.fc1[e])), self.fc2[e])
            outs.append(y)
        return torch.cat(outs) if outs else rows


def gather_expert_tensors(tensors: dict, module: nn.Module, ep_group) -> dict:
    """`tensors` ({logical name: this rank's tensor}) with every routed-expert entry of `module`
    replaced by the whole (E, ...) tensor, all-gathered over `ep_group` along the expert dim (every
    ep rank must call; the order is the module's). For checkpoints' and parity checks' whole views."""
    out = dict(tensors)
    for p in module.parameters():
        name = getattr(p, "logical_name", None)
        if getattr(p, "ep_dim", None) is None or name not in out or ep_group.size == 1:
            continue
        local = out[name].contiguous()
        whole = local.new_empty((ep_group.size * local.shape[0],) + tuple(local.shape[1:]))
        comm.all_gather(whole, local, ep_group)
        out[name] = whole
    return out


__all__ = ["GroupedExperts", "expert_param", "gather_expert_tensors"]
