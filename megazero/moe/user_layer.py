"""DeepSpeed's `MoE` layer for any user's expert module (`deepspeed.moe.layer.MoE`, same signature,
same parameter names, same routing), re-exported as `megazero.moe.layer.MoE`.

    moe = MoE(hidden_size=84, expert=nn.Linear(84, 84), num_experts=4, ep_size=2, k=1)
    output, l_aux, exp_counts = moe(hidden_states)      # hidden_states (..., hidden_size)

One forward on this rank's S tokens (the input flattened to (S, M), M = hidden_size), E experts over
an expert-parallel (ep) group of P ranks, E/P of them on each rank:

1. the gate (`TopKGate`: a bias-free linear M -> E in fp32) routes the tokens with DeepSpeed's top-1 or
   top-2 gating (`megazero.moe.gating`: capacity C per expert, Random Token Selection, noise, l_aux,
   exp_counts; where it differs from megazero's own router is said there);
2. each kept route's token is copied to its slot of an (E, C, M) buffer (empty slots are zeros);
3. with P > 1 the buffer goes through one all-to-all over the ep group (equal splits: E/P experts' C
   rows to each rank), so that each rank holds (P, E/P, C, M): its local experts' slots from every rank;
4. local expert j runs on its (P, 1, C, M) slice (DeepSpeed's `Experts`: the expert must treat rows
   independently, as a linear or an MLP does; zero rows of empty slots run through it too, their
   outputs are never read, so they give no gradient);
5. the outputs go back (the reverse all-to-all), and each token's output is the sum of its routes'
   expert outputs times their gate weights (dropped routes: zero);
6. with `use_residual` (PR-MoE), ``out · c0 + mlp(x) · c1``, (c0, c1) = softmax(coefficient(x)), where
   `mlp` is the `expert` module itself (not a copy: a dense parameter) and `coefficient` a linear M -> 2.

Returns (output of the input's shape, l_aux, exp_counts) as DeepSpeed's; l_aux is not added to any
loss by the layer. Communication per forward with P > 1: two all-to-alls of E·C·M elements (the
rows for other ranks: (P−1)/P of them), and with ``drop_tokens=False`` one all-reduce (max) of one
integer, all over the ep group; backward: the two all-to-alls again. Every rank of the ep group must
route the same number of tokens when dropping (the capacity, hence the buffers' shape, depends on it,
as in DeepSpeed); the order check names the mismatch. Host synchronisations: the capacity is read on
the host once per forward (DeepSpeed's ``int(C)``; with dropping it is computed on the host anyway).

The ep group is given by `MoE.set_ep_group`, which `megazero.initialize` calls on every MoE layer
of the model (DeepSpeed's engine calls `set_deepspeed_parallelism` there). Before that the layer has
no group: at ep_size 1 it runs standalone (no process group at all); at ep_size > 1 its forward
refuses. This is the one attribute given after construction: the user builds the module before the
engine creates the process groups.

Parameters: ``deepspeed_moe.gate.wg.weight`` (E, M), ``deepspeed_moe.experts.deepspeed_experts.<j>.*``
(the rank's E/P deep copies of `expert`: local expert j is global expert ``ep_rank · E/P + j``),
and with `use_residual` ``mlp.*`` and ``coefficient.*``, as DeepSpeed names them, in the order
DeepSpeed creates them (the same seed initialises them alike); checkpoints name local expert j by its
global index (`global_expert_name`), as DeepSpeed's expert files do. Expert parameters carry
``allreduce = False`` and ``group_name = "ep_size_<P>"`` (DeepSpeed's marks, read by
`megazero.moe.utils`) and ``expert = True`` (megazero's: ZeRO reduces their gradients over the
expert-data-parallel group, averaged over all of dp, `megazero.zero.grouping.make_groups`).

Refused, by name: k other than 1 and 2, use_tutel=True, noisy_gate_policy other than None / 'None' /
'Jitter' / 'RSample', num_experts not a multiple of ep_size. `enable_expert_tensor_parallelism` is
accepted: a plain module runs at tp = 1 under megazero, where DeepSpeed's flag changes nothing.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from megazero.moe.dispatch import AllToAll
from megazero.moe.gating import Gating, multiplicative_jitter, top1gating, top2gating
from megazero.runtime.comm import GroupHandle

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


class TopKGate(nn.Module):
    """DeepSpeed's gate: ``wg`` (a bias-free linear M -> E) and the gating of `megazero.moe.gating`
    (top-1 or top-2; the eval capacity factor and no noise in eval mode)."""

    def __init__(self, model_dim: int, num_experts: int, k: int, capacity_factor: float, eval_capacity_factor: float,
                 min_capacity: int, noisy_gate_policy: str | None, drop_tokens: bool, use_rts: bool,
                 top2_2nd_expert_sampling: bool):
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.k, self.capacity_factor, self.eval_capacity_factor = k, capacity_factor, eval_capacity_factor
        self.min_capacity, self.noisy_gate_policy = min_capacity, noisy_gate_policy
        self.drop_tokens, self.use_rts, self.top2_2nd_expert_sampling = drop_tokens, use_rts, top2_2nd_expert_sampling

    def forward(self, tokens: torch.Tensor, used_token: torch.Tensor | None,
                ep_group: GroupHandle | None) -> Gating:
        """The `Gating` of `tokens` (S, M); `used_token` (S,) masks tokens out with top-1 (top-2 ignores it,
        as DeepSpeed's); `ep_group`: where ``drop_tokens=False`` agrees on the capacity."""
        x = tokens.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x)
        logits = F.linear(x, self.wg.weight.float())  # (S, E) fp32
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(logits, factor, self.min_capacity, used_token,
                              self.noisy_gate_policy if self.training else None, self.drop_tokens, self.use_rts,
                              ep_group)
        return top2gating(logits, factor, self.min_capacity, self.drop_tokens, ep_group, self.top2_2nd_expert_sampling)


class Experts(nn.Module):
    """This rank's experts: ``deepspeed_experts``, `num_local_experts` deep copies of `expert`, their
    parameters marked as expert parameters of `group_name` (see the module docstring)."""

    def __init__(self, expert: nn.Module, num_local_experts: int, group_name: str):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for e in self.deepspeed_experts:
            for p in e.parameters():
                p.allreduce = False  # DeepSpeed's mark (megazero.moe.utils.is_moe_param)
                p.group_name = group_name
                p.expert = True  # megazero's: reduced over the expert-data-parallel group

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """`inputs` (P, E/P, C, M): local expert j runs on ``inputs[:, j:j+1]``; a tuple output's first
        element is its output (DeepSpeed ignores a returned bias likewise)."""
        outs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = expert(chunk)  # (P, 1, C, M)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outs, dim=1)


class MOELayer(nn.Module):
    """Gate, dispatch, experts, combine (steps 1-5 of the module docstring); DeepSpeed's `MOELayer`,
    ``MoE.deepspeed_moe``."""

    def __init__(self, gate: TopKGate, experts: Experts, num_experts: int, ep_size: int):
        super().__init__()
        self.gate, self.experts = gate, experts
        self.num_experts, self.ep_size = num_experts, ep_size
        self.num_local_experts = num_experts // ep_size

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None,
                ep_group: GroupHandle | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        M = hidden_states.shape[-1]
        tokens = hidden_states.reshape(-1, M)  # (S, M)
        g = self.gate(tokens, used_token, ep_group)
        E, C, P = self.num_experts, g.capacity, self.ep_size
        slots = torch.where(g.indices >= 0, g.indices * C + g.locations, E * C)  # (k, S); E·C: a dropped route
        buffer = _to_slots(tokens, slots, E * C).view(E, C, M)  # (E, C, M)
        if P > 1:  # expert e's slots to rank e // (E/P); received: (P·E/P, C, M), by source rank
            splits = [self.num_local_experts] * P
            buffer = AllToAll.apply(buffer, splits, splits, ep_group)
        out = self.experts(buffer.reshape(P, self.num_local_experts, C, M))  # (P, E/P, C, M)
        out = out.reshape(E, C, M)
        if P > 1:  # back to the tokens' ranks: (E, C, M) by global expert
            out = AllToAll.apply(out, splits, splits, ep_group)
        combined = _from_slots(out.reshape(E * C, M), slots, g.gates)  # (S, M)
        return combined.reshape(hidden_states.shape), g.l_aux, g.exp_counts


def _to_slots(tokens: torch.Tensor, slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """(num_slots, M): row i is the token routed to slot i, zeros where none is. `slots` (k, S): each
    route's slot, `num_slots` for a dropped route. A gather (its backward adds each token's k slot
    gradients). Local."""
    S, M = tokens.shape
    source = torch.full((num_slots + 1,), S, dtype=torch.long, device=tokens.device)  # S: the zero row
    source.scatter_(0, slots.reshape(-1), torch.arange(S, device=tokens.device).repeat(slots.shape[0]))
    padded = torch.cat([tokens, tokens.new_zeros(1, M)])  # (S + 1, M)
    return padded.index_select(0, source[:num_slots])


def _from_slots(rows: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """(S, M): each token's routes' rows (`rows` (num_slots, M), `slots` (k, S)) times their gates (k, S),
    summed over the k routes in fp32 (a dropped route reads a zero row), in `rows`' dtype. Local."""
    k, S = slots.shape
    padded = torch.cat([rows, rows.new_zeros(1, rows.shape[-1])])  # (num_slots + 1, M)
    routed = padded.index_select(0, slots.reshape(-1)).view(k, S, -1)  # (k, S, M)
    return (routed * gates.unsqueeze(-1)).sum(0).to(rows.dtype)


class MoE(nn.Module):
    """DeepSpeed's MoE layer (`deepspeed.moe.layer.MoE`, same arguments and defaults); see the module
    docstring. `expert`: any nn.Module mapping (..., hidden_size) rows independently;
    `num_experts` split over `ep_size` ranks; `k` 1 or 2; `capacity_factor` / `eval_capacity_factor`
    (training / eval); `min_capacity`; `use_residual` (PR-MoE); `noisy_gate_policy` None, 'Jitter'
    (the gate's input, training only) or 'RSample' (Gumbel noise on the logits, top-1, training only);
    `drop_tokens` (False: capacity = the largest load over the ep group); `use_rts` (Random Token
    Selection, top-1); `top2_2nd_expert_sampling` (top-2's second expert by Gumbel sampling)."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True):
        super().__init__()
        _check_arguments(expert, num_experts, ep_size, k, noisy_gate_policy, use_tutel)
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism  # tp = 1: nothing to do
        self.ep_size, self.num_experts = ep_size, num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.ep_group: GroupHandle | None = None  # set_ep_group, by megazero.initialize
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)  # before the gate: DeepSpeed's
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,  # RNG order
                        noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, num_experts, ep_size)
        if use_residual:
            self.mlp = expert  # the module itself, a dense parameter as in DeepSpeed
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_ep_group(self, ep_group: GroupHandle) -> None:
        """Give the layer its expert-parallel group (ep_size ranks, this rank's experts being global
        experts ``ep_group.rank · E/P ...``). `megazero.initialize` calls it on every MoE layer of the model
        (with `ParallelContext.ep_group`), as DeepSpeed's engine calls `set_deepspeed_parallelism`;
        call it yourself only to use the layer outside an engine."""
        if ep_group.size != self.ep_size:
            raise ValueError(f"MoE(ep_size={self.ep_size}): the expert-parallel group given has {ep_group.size} "
                             f"ranks ({ep_group}); give a group of ep_size ranks")
        self.ep_group = ep_group
        for j, expert in enumerate(self.deepspeed_moe.experts.deepspeed_experts):
            for p in expert.parameters():
                p.expert_slot = (j, ep_group.rank * self.num_local_experts + j)  # (local, global): global_expert_name

    def forward(self, hidden_states: torch.Tensor,
                used_token: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output, l_aux, exp_counts): `output` has `hidden_states`' shape; `used_token` (tokens,) 0/1
        masks tokens out of top-1 routing (their MoE output is zero). Communicates over the ep group
        (see the module docstring)."""
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(f"MoE(ep_size={self.ep_size}) has no expert-parallel group yet: pass the model to "
                               f"megazero.initialize (it gives every MoE layer its group), or call "
                               f"set_ep_group(ParallelContext(..., ep={self.ep_size}).ep_group)")
        output, l_aux, exp_counts = self.deepspeed_moe(hidden_states, used_token, self.ep_group)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)  # (..., 2)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, l_aux, exp_counts


EXPERTS_PREFIX = ".deepspeed_experts."


def global_expert_name(name: str, param: torch.Tensor) -> str:
    """`name`, a `named_parameters` name of `param`, with a local expert's index replaced by its global
    one (``...deepspeed_experts.<j>.`` -> ``...deepspeed_experts.<ep_rank · E/P + j>.``, DeepSpeed's rule
    for the names in its expert checkpoint files) once `MoE.set_ep_group` has placed the expert; other
    names unchanged. Every ep rank's experts then have names of their own (checkpoints)."""
    slot = getattr(param, "expert_slot", None)
    if slot is None:
        return name
    local, global_ = slot
    return name.replace(f"{EXPERTS_PREFIX}{local}.", f"{EXPERTS_PREFIX}{global_}.", 1)


def _check_arguments(expert, num_experts: int, ep_size: int, k: int, noisy_gate_policy, use_tutel: bool) -> None:
    if not isinstance(expert, nn.Module):
        raise TypeError(f"MoE(expert=...): an nn.Module (the expert to copy num_experts / ep_size times), got "
                        f"{type(expert).__name__}")
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"MoE(ep_size={ep_size!r}): a positive integer")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1 or num_experts % ep_size:
        raise ValueError(f"MoE(num_experts={num_experts!r}, ep_size={ep_size}): num_experts must be a positive "
                         f"multiple of ep_size (each of the ep_size ranks holds num_experts / ep_size experts)")
    if k not in (1, 2):
        raise ValueError(f"MoE(k={k!r}): megazero implements DeepSpeed's top-1 and top-2 gating (the k its MoE "
                         f"documents); DeepSpeed's top-k gating for k > 2 (drop policies, renormalised weights) is "
                         f"not implemented: use k=1 or k=2")
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(f"MoE(noisy_gate_policy={noisy_gate_policy!r}): one of None, 'None', 'Jitter', 'RSample'")
    if use_tutel:
        raise ValueError("MoE(use_tutel=True): megazero does not use Tutel's kernels (its dispatch is megazero's "
                         "own, with DeepSpeed's routing, giving the same results); pass use_tutel=False")


__all__ = ["Experts", "MOELayer", "MoE", "TopKGate", "global_expert_name"]
