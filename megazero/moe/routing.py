"""The router's decision for a batch of sequences (no communication, no host synchronisation: every
result stays on the device, counts included): top-k experts per token, their weights, which
assignments fit each expert's capacity, and the load-balancing and z losses.

Tokens come as rows ``(b·s, h)`` with sequence j in rows ``j·s .. j·s+s−1``; capacity and both
losses are per sequence (see `megazero.core.moe_spec`), so a sequence routes the same way in any
layout. With context parallelism (`cp_group`) a rank holds s/cp tokens of each sequence: the load-balancing
loss's per-sequence counts and mean probabilities are summed over the cp group (two all-reduces of (b, E),
the probabilities' with their gradient, `megazero.context_parallel.sum_over`); capacity is not supported
there yet (the engine refuses it).

Two parts: `decide` makes the discrete choice (which experts, which assignments are kept) without
autograd; `route` computes what is differentiable from the logits (the weights, gathered at the chosen
experts, and the losses) for a decision, its own or one given (an activation recompute replays the
forward's decision: `megazero.moe.layer.MoELayer`). Either way `route` runs the same autograd
operations, so a recompute saves the same tensors for backward as the forward did.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megazero.context_parallel.sum_over import sum_over
from megazero.core.moe_spec import MoESpec
from megazero.runtime import comm


@dataclass
class Decision:
    """`indices`: (b·s, k) chosen experts, best first; `keep`: (b·s, k) bool, the assignments within
    capacity. No autograd history."""

    indices: torch.Tensor
    keep: torch.Tensor


@dataclass
class Routing:
    """`indices`, `weights`: (b·s, k) chosen experts and their weights (fp32, differentiable);
    `keep`: (b·s, k) bool, the assignments within capacity; `aux_loss`, `z_loss`: 0-d fp32 tensors
    (coefficients not applied); `tokens_per_expert`: (E,) int64, kept assignments; `dropped`: 0-d int64,
    assignments dropped. All on the logits' device: nothing here is read on the host."""

    indices: torch.Tensor
    weights: torch.Tensor
    keep: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    dropped: torch.Tensor


def _scores(logits: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    return torch.softmax(logits, dim=-1) if spec.score == "softmax" else torch.sigmoid(logits)  # (b·s, E)


def _choices(indices: torch.Tensor, seq_len: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(by_choice (b, k·s): each sequence's choices, first choices first; chose (b, k·s, E) one-hot)."""
    rows, k = indices.shape
    b = rows // seq_len
    by_choice = indices.view(b, seq_len, k).transpose(1, 2).reshape(b, k * seq_len)  # (b, k·s)
    chose = torch.zeros(b, seq_len * k, num_experts, dtype=torch.float32, device=indices.device)
    chose.scatter_(2, by_choice.unsqueeze(-1), 1.0)
    return by_choice, chose


@torch.no_grad()
def decide(logits: torch.Tensor, seq_len: int, spec: MoESpec) -> Decision:
    """The top-k experts of each token whose router logits are `logits` (b·s, E), fp32, and which of
    its assignments fit their expert's capacity (first choices, then by position, per sequence)."""
    indices = _scores(logits, spec).topk(spec.top_k, dim=-1).indices  # (b·s, k)
    capacity = spec.capacity(seq_len)
    if capacity is None:
        return Decision(indices, torch.ones_like(indices, dtype=torch.bool))
    b, k = logits.shape[0] // seq_len, spec.top_k
    by_choice, chose = _choices(indices, seq_len, spec.num_experts)
    queue = chose.cumsum(1).gather(2, by_choice.unsqueeze(-1)).squeeze(-1) - 1  # (b, k·s): place in its queue
    keep = (queue < capacity).view(b, k, seq_len).transpose(1, 2).reshape(b * seq_len, k)
    return Decision(indices, keep)


def route(logits: torch.Tensor, seq_len: int, spec: MoESpec, decision: Decision | None = None,
          cp_group: comm.GroupHandle | None = None) -> Routing:
    """Route tokens whose router logits are `logits` (b·s, E), fp32, as `decision` says (default:
    `decide` on these logits): the weights are the scores at the chosen experts (renormalised over
    the k when ``normalize_topk`` and k > 1; with k = 1 the score itself, as Switch: else the weight is
    always 1 and the language-model loss would give the router no gradient). `cp_group`: the ranks holding the
    sequences' other tokens (context parallelism; `seq_len` is then this rank's s/cp): the aux loss is the whole
    sequence's (module docstring)."""
    E = spec.num_experts
    b = logits.shape[0] // seq_len
    d = decision if decision is not None else decide(logits, seq_len, spec)
    probs = _scores(logits, spec)  # (b·s, E)
    top = probs.gather(-1, d.indices)  # (b·s, k)
    weights = top / top.sum(-1, keepdim=True) if spec.normalize_topk and spec.top_k > 1 else top
    # per-sequence load balancing: f_e (share of the k·s assignments, before dropping) · P_e (mean probability)
    _, chose = _choices(d.indices, seq_len, E)
    cp = 1 if cp_group is None else cp_group.size
    counts = chose.sum(1)  # (b, E)
    if cp > 1:  # the whole sequence's assignments (no gradient)
        comm.all_reduce(counts, cp_group)
    f = counts / (seq_len * cp * spec.top_k)  # (b, E)
    p = probs if spec.score == "softmax" else probs / probs.sum(-1, keepdim=True)
    P = sum_over(p.view(b, seq_len, E).sum(1), cp_group) / (seq_len * cp)  # (b, E): the sequence's mean
    aux = (E * (f * P).sum(-1)).mean()
    z = torch.logsumexp(logits, dim=-1).square().mean()
    with torch.no_grad():  # counted on the device (bincount and mask indexing would wait for it)
        kept = d.keep.flatten().long()  # (b·s·k,)
        tokens = torch.zeros(E, dtype=torch.long, device=logits.device).scatter_add_(0, d.indices.flatten(), kept)
        dropped = kept.numel() - kept.sum()  # 0-d
    return Routing(d.indices, weights, d.keep, aux, z, tokens, dropped)


__all__ = ["Decision", "Routing", "decide", "route"]
