"""The routed experts of one MoE layer held by one expert-parallel rank, run as a group.

Parameters are stacked over this rank's E/P experts: GeLU / ReLU ``fc1`` (E/P, f, h) and ``fc2`` (E/P, h, f);
SwiGLU ``gate`` and ``up`` (E/P, f, h) and ``down`` (E/P, h, f). Their logical tensors are (E, ...),
split over the ep group on dim 0 (``ep_dim = 0``). With biases (the model's MLP biases): ``fc1_bias``,
``gate_bias``, ``up_bias`` (E/P, f) and ``fc2_bias``, ``down_bias`` (E/P, h), zero-initialised.

Expert tensor parallelism (Megatron-LM's expert_tensor_parallel_size = TP): with an expert TP group of
t > 1 ranks each expert's ffn dim is split over it like the dense MLP's: gate / up / fc1 and their biases
column-parallel (shard (E/P, f/t, h), ``tp_dim = 1``), down / fc2 row-parallel (shard (E/P, h, f/t),
``tp_dim = 2``), the output biases replicated. With a group of one rank the experts are whole on every
TP rank (TP replicated, ``tp_dim`` None). Each expert's initial values depend only on the seed, the
parameter's name and the expert's global index (`megazero.tensor_parallel.init.make_param` draws the
TP shard of the logical (f, h) tensor of expert e), so every layout starts from the same model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazero.runtime import comm
from megazero.runtime.comm import GroupHandle, single_rank_group
from megazero.tensor_parallel.init import local_size, make_param
from megazero.tensor_parallel.mappings import copy_to_tp_region, reduce_from_tp_region


_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


def expert_param(local: int, num_experts: int, ep_rank: int, shape: tuple[int, ...], name: str, seed: int,
                 std: float, device, dtype, routed: bool = True, tp_dim: int | None = None,
                 tp_group: GroupHandle | None = None, init: str = "normal") -> nn.Parameter:
    """This ep rank's `local` experts of the logical (num_experts, *shape) parameter `name`; `routed`
    False for a shared expert (one, on every rank, a dense parameter). `tp_dim` (a dim of the stacked
    tensor, 1 or 2): the dim split over `tp_group` (None, or a group of one rank: whole)."""
    tp_group = tp_group or single_rank_group("tp")
    if tp_group.size == 1:
        tp_dim = None
    t = tp_group.size if tp_dim is not None else 1
    rank = tp_group.rank if tp_dim is not None else 0
    each_shape = tuple(local_size(n, t, f"{name}: dim {d + 1}") if d + 1 == tp_dim else n for d, n in enumerate(shape))
    first = ep_rank * local
    each = [make_param(each_shape, logical_name=f"{name}[{e}]", full_shape=shape,
                       tp_dim=None if tp_dim is None else tp_dim - 1, tp_rank=rank, tp_size=t, init=init,
                       seed=seed, std=std, device=device, dtype=dtype).data
            for e in range(first, first + local)]  # expert e's values depend on (seed, name, e) only
    p = nn.Parameter(torch.stack(each))  # (local, *shape with dim tp_dim / t)
    p.logical_name, p.full_shape = name, (num_experts,) + tuple(shape)
    p.tp_dim, p.tp_rank, p.tp_size, p.sequence_parallel = tp_dim, rank, t, False  # tp_dim None: TP replicated
    if routed:
        p.ep_dim, p.ep_rank, p.ep_size = 0, ep_rank, num_experts // local
    if init == "zeros":
        p.no_weight_decay = True  # a bias, as the dense layers' (megazero.zero.param_groups)
    p.expert = routed
    return p


class GroupedExperts(nn.Module):
    """Experts ``ep_rank·local .. (ep_rank+1)·local − 1`` of a layer (global names ``{name}.fc1`` ...);
    with `routed` False, the layer's shared expert (num_experts = local = 1, dense). `tp_group`: the
    expert TP group their ffn dim is split over (None: whole experts). `bias`: the MLP biases."""

    def __init__(self, hidden: int, ffn: int, activation: str, num_experts: int, local: int, ep_rank: int,
                 name: str, seed: int, std: float, out_std: float, device=None, dtype=torch.float32,
                 routed: bool = True, tp_group: GroupHandle | None = None, bias: bool = False):
        super().__init__()
        self.activation, self.local = activation, local
        self.tp_group = tp_group or single_rank_group("tp")
        make = dict(local=local, num_experts=num_experts, ep_rank=ep_rank, seed=seed, device=device, dtype=dtype,
                    routed=routed, tp_group=self.tp_group)
        ins = ("gate", "up") if activation == "swiglu" else ("fc1",)
        out = "down" if activation == "swiglu" else "fc2"
        for n in ins:  # column-parallel
            setattr(self, n, expert_param(shape=(ffn, hidden), name=f"{name}.{n}", std=std, tp_dim=1, **make))
            setattr(self, f"{n}_bias", expert_param(shape=(ffn,), name=f"{name}.{n}_bias", std=0.0, tp_dim=1,
                                                    init="zeros", **make) if bias else None)
        setattr(self, out, expert_param(shape=(hidden, ffn), name=f"{name}.{out}", std=out_std, tp_dim=2, **make))
        self.out_bias_name = f"{out}_bias"
        setattr(self, self.out_bias_name, expert_param(shape=(hidden,), name=f"{name}.{out}_bias", std=0.0,
                                                       init="zeros", **make) if bias else None)

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`rows` (N, h) grouped by local expert, `counts[e]` rows each; returns (N, h).

        Communication over the expert TP group (none with one rank): f on the rows (identity forward,
        all-reduce of their gradient backward) and g on the outputs (all-reduce of the partial sums
        forward, identity backward), so the outputs are whole and the rows' gradient equal on every TP
        rank; the output bias is added after the all-reduce. Both run with N = 0 too (an ep rank no
        token was sent to): a TP rank never skips a collective its peers issue. The TP ranks hold the
        same rows: their hidden states are bit-identical (the MoE combine is deterministic,
        `megazero.moe.layer.combine`) and the replicated router decides on them alike, so the
        all-reduces' shapes, which follow `rows`, agree."""
        tp = self.tp_group
        split = tp.size > 1
        if split:
            rows = copy_to_tp_region(rows, tp)
        outs = []
        for e, part in enumerate(rows.split(counts)):
            if self.activation == "swiglu":
                inner = F.silu(F.linear(part, self.gate[e], _row(self.gate_bias, e))) * F.linear(
                    part, self.up[e], _row(self.up_bias, e))  # (n_e, f/t)
                y = F.linear(inner, self.down[e])
            else:
                y = F.linear(_ACTIVATIONS[self.activation](F.linear(part, self.fc1[e], _row(self.fc1_bias, e))),
                             self.fc2[e])
            outs.append(y)  # (n_e, h), a partial sum over the expert TP group
        y = torch.cat(outs)  # (N, h)
        if split:
            y = reduce_from_tp_region(y, tp)
        out_bias = getattr(self, self.out_bias_name)
        if out_bias is not None:
            y = y + torch.cat([out_bias[e].expand(n, -1) for e, n in enumerate(counts)])  # (N, h): each row its expert's
        return y


def _row(bias: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if bias is None else bias[e]


def gather_expert_tensors(tensors: dict, module: nn.Module, ep_group) -> dict:
    """`tensors` ({logical name: this rank's tensor}) with every routed-expert entry of `module`
    replaced by the whole (E, ...) tensor, all-gathered over `ep_group` along the expert dim (every
    ep rank must call; the order is the module's). For checkpoints' and parity checks' whole views
    (gather over the TP group first: `megazero.tensor_parallel.gather_full_tensors`)."""
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
