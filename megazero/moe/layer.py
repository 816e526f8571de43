"""The Mixture-of-Experts MLP: route, dispatch over the expert-parallel group, run the local experts,
bring the outputs back and combine them weighted; shared experts run on every token.

(`MoE`, DeepSpeed's layer for a user's own expert module with DeepSpeed's routing, lives in
`megazero.moe.user_layer`; it is imported here so that ``from megazero.moe.layer import MoE`` works as
``from deepspeed.moe.layer import MoE`` does.)

One forward on x (s, b, h), E experts over an ep group of P ranks, k experts per token:

1. router logits (b·s, E) = tokens · routerᵀ in fp32; `megazero.moe.routing.decide` picks the top k
   and the assignments within capacity; `dispatch.plan_dispatch` sorts the b·s·k assignments by
   expert (stable argsort of a key: the expert, or E when dropped) and, with P > 1, exchanges the
   rows per expert over `ep_group` (`dispatch.exchange_counts`) and reads the all-to-all's split sizes
   on the host: the `DispatchPlan`; `megazero.moe.routing.route` computes the weights and the aux and
   z losses (and the counts for the statistics, on the device);
2. the assignments, sorted by expert, are gathered into rows (n, h): with P = 1 all b·s·k of them, the
   dropped ones after the last expert's; with P > 1 the kept ones only, sent to the rank of their
   expert (`dispatch.AllToAll` over `ep_group`);
3. the received rows, regrouped by local expert, go through `experts.GroupedExperts` (one grouped GEMM
   per weight; with P = 1 the dropped rows, past the counts, give zero outputs and gradients; with
   expert tensor parallelism, over the expert TP group: f on the rows, g on the outputs, so that the
   outputs are whole before they are weighted: the router, replicated over TP, gets the same gradient
   on every TP rank);
4. the outputs go back (the reverse all-to-all), are scaled by their weights and summed per token in
   a fixed order (`combine`: each in its (token, slot) cell of a (b·s, k, h) tensor, summed over k; not
   `index_add`, whose CUDA kernel adds in no fixed order for k >= 3, so TP replicas could hold hidden
   states differing in the low bits, route differently at the next layer and size their expert TP
   all-reduces differently; the rows' gather of step 2 sums its gradient the same way, `GatherRows`);
   the shared experts' output is added; the result is (s, b, h).

Host synchronisations: none with one ep rank; with P > 1 exactly one per forward, the `.tolist()` of
the split sizes in step 1 (NCCL's all-to-all takes them on the host), and none in a recompute. (Where
grouped GEMMs cannot run, the experts' padded fallback reads the largest count once with P = 1.)

Under activation recompute the replayed forward reuses the forward's `DispatchPlan` (see `MoELayer`):
numerics that are not bit-identical (another GPU kernel in the recompute) could otherwise route a
near-tied token elsewhere, change the all-to-all split sizes between ranks and hang or corrupt them;
the plan carries the split sizes already on the host, so the recompute does not wait for the device.
The weights are still recomputed, differentiably, from the replayed logits at the saved experts.

The aux and z losses join the training loss through their gradient (`AttachLosses`): the layer's
output carries them, and backward adds ``coef · aux_scale()`` times their gradient, so a pipeline
stage needs no extra loss tensor (`aux_scale` gives the loss's scale: 1 / micro-batches, times the
loss scale). Communication per forward, rank r sending n_j rows to rank j: Σ_{j≠r} n_j · h elements
out and the same back, and E − E/P integers of counts (not in a recompute); backward moves the rows'
gradients the same way. With expert tensor parallelism over t ranks, each also all-reduces its
received rows' outputs (M, h) forward and their gradients backward over the expert TP group, and the
shared experts' (b·s, h) likewise.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megazero.core.moe_spec import MoESpec
from megazero.moe.dispatch import AllToAll, DispatchPlan, plan_dispatch
from megazero.moe.experts import GroupedExperts
from megazero.moe.routing import Routing, decide, route
from megazero.moe.user_layer import MoE  # DeepSpeed's MoE for a user's expert: `from megazero.moe.layer import MoE`
from megazero.runtime.comm import GroupHandle
from megazero.tensor_parallel.init import make_param


class AuxLossScale:
    """The factor the aux losses' gradients take in one step: 1 / micro-batches times the loss scale,
    as the language-model loss is scaled. Each MoE layer holds one (its own, or one given at
    construction); the engine that runs the steps sets them all (`set_aux_loss_scale`), and backward
    reads it."""

    def __init__(self, value: float = 1.0):
        self.value = value

    def set(self, value: float) -> None:
        self.value = float(value)

    def __call__(self) -> float:
        return self.value


class AttachLosses(torch.autograd.Function):
    """Identity on `output`; backward also gives `aux` and `z` the gradients ``coef · scale()`` (the
    scale read when backward runs) and calls `on_backward()` (once per micro-batch even under
    activation recompute: only the graph that is backpropagated calls it)."""

    @staticmethod
    def forward(ctx, output, aux, z, coefs: tuple[float, float], scale, on_backward):
        ctx.coefs, ctx.scale, ctx.on_backward = coefs, scale, on_backward
        ctx.like = (aux, z)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        aux, z = ctx.like
        ctx.on_backward()
        s = ctx.scale()
        return (grad, torch.full_like(aux, ctx.coefs[0] * s), torch.full_like(z, ctx.coefs[1] * s), None, None,
                None)


def set_aux_loss_scale(module: nn.Module, value: float) -> int:
    """Set the aux-loss gradient factor of every `MoELayer` in `module` (their shared `AuxLossScale` or
    their own) to `value`; returns how many layers there are."""
    layers = [m for m in module.modules() if isinstance(m, MoELayer)]
    for m in layers:
        if isinstance(m.aux_scale, AuxLossScale):
            m.aux_scale.set(value)
    return len(layers)


class RoutingStats:
    """Sums over the micro-batches trained since the last `pop`, on the device (no host sync): aux and z
    losses, dropped assignments, micro-batches, kept assignments per expert."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.sums: torch.Tensor | None = None  # (4 + E,) fp64: [aux, z, dropped, micro-batches, tokens...]

    def add(self, r: Routing) -> None:
        row = torch.cat([torch.stack([r.aux_loss.detach().double(), r.z_loss.detach().double(), r.dropped.double(),
                                      torch.ones((), dtype=torch.float64, device=r.dropped.device)]),
                         r.tokens_per_expert.double()])  # (4 + E,)
        self.sums = row if self.sums is None else self.sums + row

    def pop(self) -> torch.Tensor | None:
        """[aux, z, dropped, micro-batches, tokens per expert...] (4 + E,) fp64 on the device, summed since
        the last pop (None when nothing was added); resets."""
        out, self.sums = self.sums, None
        return out


class MoELayer(nn.Module):
    """An MoE MLP named `name` (parameters ``{name}.router`` (E, h), ``{name}.experts.*`` split over
    `ep_group`, ``{name}.shared.*``). `aux_scale`: the `AuxLossScale` the losses' gradients take (its
    own, 1.0, when not given; an engine sets every MoE layer's per step: `set_aux_loss_scale`).
    `expert_tp_group`: the TP group the experts' (routed and shared) ffn dim is split over (expert
    tensor parallelism; None: whole experts on every TP rank). `bias`: experts with the MLP biases.
    `decisions`: an activation checkpointer's record of discrete choices
    (`megazero.activation_checkpoint.region.Decisions`): under recompute the replayed forward reuses
    the original forward's `DispatchPlan` instead of routing again, so the all-to-all splits cannot
    change between the two (None: always route). `cp_group`: with context parallelism, the ranks holding the
    other s/cp-token parts of the sequences (the load-balancing loss is the whole sequence's; `route`).
    After each forward, `last_routing` holds that forward's `Routing` (statistics for the metrics)."""

    def __init__(self, spec: MoESpec, hidden: int, ep_group: GroupHandle, name: str, seed: int,
                 init_std: float = 0.02, out_std: float | None = None, device=None, dtype=torch.float32,
                 aux_scale: Callable[[], float] | None = None, expert_tp_group: GroupHandle | None = None,
                 bias: bool = False, decisions=None, cp_group: GroupHandle | None = None):
        super().__init__()
        spec.check(ep_group.size)
        self.spec, self.ep_group, self.decisions = spec, ep_group, decisions
        self.cp_group = cp_group  # context parallel: the sequences' other tokens are there (the aux loss's sums)
        self.aux_scale = aux_scale if aux_scale is not None else AuxLossScale()  # the engine sets it per step
        self.name = name  # layers.<i>.mlp
        E, P = spec.num_experts, ep_group.size
        out_std = init_std if out_std is None else out_std
        self.router = make_param((E, hidden), logical_name=f"{name}.router", full_shape=(E, hidden), tp_dim=None,
                                 tp_rank=0, tp_size=1, init="normal", seed=seed, std=init_std, device=device,
                                 dtype=dtype)
        common = dict(device=device, dtype=dtype, tp_group=expert_tp_group, bias=bias)
        self.experts = GroupedExperts(hidden, spec.ffn, spec.activation, E, E // P, ep_group.rank,
                                      f"{name}.experts", seed, init_std, out_std, **common)
        self.shared = None
        if spec.shared_experts:
            width = (spec.shared_ffn or spec.ffn) * spec.shared_experts  # DeepSeek: the shared experts as one MLP
            self.shared = GroupedExperts(hidden, width, spec.activation, 1, 1, 0, f"{name}.shared", seed, init_std,
                                         out_std, routed=False, **common)
        self.last_routing: Routing | None = None
        self.stats = RoutingStats(spec.num_experts)  # the trained micro-batches' routing, until popped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        tokens = x.transpose(0, 1).reshape(b * s, h)  # (b·s, h): sequence j in rows j·s .. j·s+s−1
        logits = self.router_logits(tokens)  # (b·s, E), fp32
        if self.decisions is None:
            plan = self._plan(logits, s)
        else:  # recorded in a checkpointed forward, replayed in its recompute
            plan = self.decisions.remember(self.name, lambda: self._plan(logits, s))
        r = route(logits, s, self.spec, plan.decision, self.cp_group)
        if self.decisions is None or not self.decisions.replaying:  # statistics of the forward, not its recompute
            self.last_routing = dataclasses.replace(r, weights=r.weights.detach(), aux_loss=r.aux_loss.detach(),
                                                    z_loss=r.z_loss.detach())  # holds no graph
        token, slot = plan.token, plan.slot
        rows = GatherRows.apply(tokens, token, slot, self.spec.top_k)  # (n, h) tokens[token], deterministic backward
        y = self._run_experts(rows, plan)  # (n, h), in the same order
        weighted = y * r.weights[token, slot].unsqueeze(-1).to(y.dtype)
        out = combine(weighted, token, slot, b * s, self.spec.top_k)  # (b·s, h)
        if self.shared is not None:
            out = out + self.shared(tokens)
        out = out.view(b, s, h).transpose(0, 1)  # (s, b, h)
        return AttachLosses.apply(out, r.aux_loss, r.z_loss, (self.spec.aux_loss_coef, self.spec.z_loss_coef),
                                  self.aux_scale, lambda: self.stats.add(r))

    def router_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(b·s, E) fp32 router logits of `tokens` (b·s, h)."""
        return F.linear(tokens.float(), self.router.float())

    def _plan(self, logits: torch.Tensor, seq_len: int) -> DispatchPlan:
        """Decide the routing and where its rows go (`megazero.moe.dispatch.plan_dispatch`: with more than
        one ep rank one all-to-all of E/P integers per peer over the ep group and the layer's one host
        synchronisation, the split sizes)."""
        return plan_dispatch(decide(logits, seq_len, self.spec), self.spec.num_experts, self.ep_group)

    def _run_experts(self, rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """`rows` (n, h) sorted by expert (`DispatchPlan`): send each to its expert's ep rank, run the local
        experts (over the expert TP group: `GroupedExperts.forward`), return their whole outputs in
        `rows`' order (zero for dropped assignments). No host synchronisation: the splits are the plan's."""
        group = self.ep_group
        if group.size == 1:  # every assignment has a row: the dropped ones, past the counts, give zeros
            return self.experts(rows, plan.counts, padded=self.spec.capacity_factor is not None)
        M = sum(plan.recvs)
        arrived = AllToAll.apply(rows, plan.recvs, plan.sends, group)  # (M, h), by (source rank, local expert)
        local = torch.arange(len(plan.local), device=rows.device).repeat(group.size)  # (P·E/P,) expert of each block
        expert_of_row = local.repeat_interleave(plan.received.flatten(), output_size=M)  # (M,)
        regroup = torch.argsort(expert_of_row, stable=True)  # by (local expert, source rank)
        out = self.experts(arrived[regroup], plan.received.sum(0), known=plan.local)  # (M, h)
        inverse = torch.empty_like(regroup).scatter_(0, regroup, torch.arange(M, device=regroup.device))
        return AllToAll.apply(out[inverse], plan.sends, plan.recvs, group)  # back in arrival order, then home


class GatherRows(torch.autograd.Function):
    """``tokens[token]``: the rows (N, h) of the kept assignments, `slot` (N,) their slots among the k of
    their token. Backward sums each token's row gradients with `combine` instead of indexing's
    scatter-add (CUDA atomics, in no fixed order for k >= 2), so the tokens' gradient, hence the
    replicated router and norm weights' gradients, are the same bits on every TP rank. Local."""

    @staticmethod
    def forward(ctx, tokens, token, slot, k: int):
        ctx.save_for_backward(token, slot)
        ctx.k, ctx.n = k, tokens.shape[0]
        return tokens[token]

    @staticmethod
    def backward(ctx, grad):
        token, slot = ctx.saved_tensors
        return combine(grad, token, slot, ctx.n, ctx.k), None, None, None


def combine(weighted: torch.Tensor, token: torch.Tensor, slot: torch.Tensor, tokens: int, k: int) -> torch.Tensor:
    """Each token's sum of its weighted expert outputs: `weighted` (N, h), row i for slot `slot[i]` of
    token `token[i]` (each (token, slot) at most once; a dropped assignment has no row), into (tokens, h).

    The rows are placed in their cells of a (tokens, k, h) tensor (no accumulation) and summed over k,
    so the result does not depend on the order of the rows nor on atomics: the same bits on every TP
    rank. Backward gathers the cells' gradients (deterministic too). Local: no communication."""
    cells = weighted.new_zeros(tokens, k, weighted.shape[-1]).index_put((token, slot), weighted)
    return cells.sum(1)


__all__ = ["AttachLosses", "AuxLossScale", "DispatchPlan", "GatherRows", "MoE", "MoELayer", "combine",
           "set_aux_loss_scale"]
