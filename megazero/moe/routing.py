"""The router's decision for a batch of sequences (no communication): top-k experts per token, their
weights, which assignments fit each expert's capacity, and the load-balancing and z losses.

Tokens come as rows ``(b·s, h)`` with sequence j in rows ``j·s .. j·s+s−1``; capacity and both
losses are per sequence (see `megazero.core.moe_spec`), so a sequence routes the same way in any
layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megazero.core.moe_spec import MoESpec


@dataclass
class Routing:
    """`indices`, `weights`: (b·s, k) chosen experts and their weights (fp32, differentiable);
    `keep`: (b·s, k) bool, the assignments within capacity; `aux_loss`, `z_loss`: 0-d fp32 tensors
    (coefficients not applied); `tokens_per_expert`: (E,) kept assignments; `dropped`: assignments
    dropped (an int)."""

    indices: torch.Tensor
    weights: torch.Tensor
    keep: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    dropped: int


def route(logits: torch.Tensor, seq_len: int, spec: MoESpec) -> Routing:
    """Route tokens whose router logits are `logits` (b·s, E), fp32."""
    E, k = spec.num_experts, spec.top_k
    rows = logits.shape[0]
    b = rows // seq_len
    probs = torch.softmax(logits, dim=-1) if spec.score == "softmax" else torch.sigmoid(logits)  # (b·s, E)
    top, indices = probs.topk(k, dim=-1)  # (b·s, k)
    # renormalised over the k (with k = 1 the score itself, as Switch: else the weight is always 1 and the
    # language-model loss would give the router no gradient)
    weights = top / top.sum(-1, keepdim=True) if spec.normalize_topk and k > 1 else top
    # per-sequence load balancing: f_e (share of the k·s assignments, before dropping) · P_e (mean probability)
    chose = torch.zeros(b, seq_len * k, E, dtype=torch.float32, device=logits.device)
    by_choice = indices.view(b, seq_len, k).transpose(1, 2).reshape(b, k * seq_len)  # (b, k·s): first choices first
    chose.scatter_(2, by_choice.unsqueeze(-1), 1.0)
    f = chose.sum(1) / (seq_len * k)  # (b, E)
    p = probs if spec.score == "softmax" else probs / probs.sum(-1, keepdim=True)
    P = p.view(b, seq_len, E).mean(1)  # (b, E)
    aux = (E * (f * P).sum(-1)).mean()
    z = torch.logsumexp(logits, dim=-1).square().mean()
    capacity = spec.capacity(seq_len)
    if capacity is None:
        keep = torch.ones_like(indices, dtype=torch.bool)
    else:  # position of each assignment in its expert's queue: first choices, then by position
        queue = chose.cumsum(1).gather(2, by_choice.unsqueeze(-1)).squeeze(-1) - 1  # (b, k·s)
        keep = (queue < capacity).view(b, k, seq_len).transpose(1, 2).reshape(rows, k)
    tokens = torch.bincount(indices[keep], minlength=E)
    return Routing(indices, weights, keep, aux, z, tokens, int((~keep).sum()))


__all__ = ["Routing", "route"]
