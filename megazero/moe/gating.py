"""DeepSpeed's top-1 and top-2 gating (GShard / Switch Transformer, as `deepspeed.moe.sharded_moe`'s
`top1gating` and `top2gating`), for the user-facing `megazero.moe.user_layer.MoE`.

Every decision is DeepSpeed's, computed with the same torch operations in the same order (so the same
random draws give the same routing; `tests/test_user_moe.py` compares with DeepSpeed's functions):
the gate sees all S tokens of this rank at once (not per sequence), each expert has one capacity
C = max(ceil(S / E · capacity_factor · k), min_capacity) for the rank's tokens, and exceeding tokens are
dropped (their output is zero). How this differs from megazero's own router (`megazero.moe.routing`,
used by the MoE MLP of spec-built models):

- capacity: here per rank over all of its tokens, there per sequence;
- which tokens stay: top-1 keeps, per expert, the C tokens with the largest random key when
  `use_rts` (Random Token Selection: a uniform draw per token), else the ones `torch.topk` picks among
  equals; top-2 keeps the earliest tokens, all first choices before any second choice; megazero's
  router keeps the earliest positions of each sequence;
- weights: top-1 uses the softmax probability of the chosen expert as it is; top-2 renormalises the two
  kept ones to sum to 1 (a dropped choice counts 0); megazero normalises over the top k before dropping;
- the second expert of top-2 is, by default, drawn with the Gumbel-max trick on the logits
  (`top2_2nd_expert_sampling`), also in eval mode; megazero's router takes the top k deterministically;
- aux loss: top-1 ``E · Σ_e mean_s(p_e) · frac_e`` and top-2 ``E² · mean_e(mean_s(p_e) · frac_e)``
  (= E · Σ_e ...: the same value), with frac_e the fraction of tokens whose *first* choice is e, before
  capacity; no z-loss. The aux loss is returned to the caller (DeepSpeed's `l_aux`), who adds it to the
  loss or not; megazero's layer adds its losses' gradients itself;
- `exp_counts`: tokens per expert among the choices made (top-1: first choices, top-2: both), before
  capacity drops.

With ``drop_tokens=False`` the capacity is the largest expert load, all-reduced (max) over the
expert-parallel group so that every rank's all-to-all buffers have one shape: the one collective
here. Under tensor parallelism DeepSpeed pads that capacity to a multiple of the TP size; a user's
plain module runs at tp = 1 under megazero, where the padding is 1.

Noise (`noisy_gate_policy`, top-1 only for RSample) and the random draws use torch's default
generator through `torch.distributions` exactly as DeepSpeed draws them (a Gumbel sample of the
logits' shape before anything else, then the uniform keys for Random Token Selection), so seeding
torch reproduces DeepSpeed's routing. Functions here hold no state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megazero.runtime import comm
from megazero.runtime.comm import GroupHandle


@dataclass
class Gating:
    """The routing of S tokens to E experts with k choices each (DeepSpeed's sparse routes).

    `indices` (k, S) int64: the expert of each route, -1 where the route was dropped (over capacity, or
    a token `used_token` masks); `locations` (k, S) int64: its slot in that expert's buffer of
    `capacity` rows (0 when dropped); `gates` (k, S) fp32: its weight, differentiable towards the
    logits (0 when dropped); `l_aux` 0-d: the load-balancing loss (differentiable); `exp_counts` (E,):
    routes chosen per expert before capacity (no gradient); `capacity` (host int): rows per expert."""

    l_aux: torch.Tensor
    capacity: int
    indices: torch.Tensor
    locations: torch.Tensor
    gates: torch.Tensor
    exp_counts: torch.Tensor


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> torch.Tensor:
    """DeepSpeed's expert capacity: ceil(num_tokens / num_experts · capacity_factor), at least
    `min_capacity`, as a 0-d int64 tensor (computed in fp32 as DeepSpeed's, so that it rounds alike).
    Top-2 passes 2 · capacity_factor."""
    c = torch.ceil((num_tokens / num_experts) * torch.tensor(capacity_factor)).to(torch.int64)
    return torch.maximum(c, torch.tensor(min_capacity).to(torch.int64))


def _gumbel(shape, device) -> torch.Tensor:
    """A standard Gumbel sample of `shape` from torch's generator, drawn as DeepSpeed's `gumbel_rsample`."""
    zero, one = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
    return torch.distributions.gumbel.Gumbel(zero, one).rsample(shape)


def _uniform(shape, device, low: float, high: float) -> torch.Tensor:
    """A uniform sample in [low, high) of `shape` from torch's generator, drawn as DeepSpeed draws its
    jitter and Random Token Selection keys."""
    lo, hi = torch.tensor(low, device=device), torch.tensor(high, device=device)
    return torch.distributions.uniform.Uniform(low=lo, high=hi).rsample(shape)


def multiplicative_jitter(x: torch.Tensor, epsilon: float = 1e-2) -> torch.Tensor:
    """`x` times a uniform draw in [1 − epsilon, 1 + epsilon) per element (noisy_gate_policy 'Jitter',
    applied to the gate's input in training, as DeepSpeed's)."""
    if epsilon == 0:
        return x
    return x * _uniform(x.shape, x.device, 1.0 - epsilon, 1.0 + epsilon)


def _no_drop_capacity(exp_counts: torch.Tensor, ep_group: GroupHandle | None) -> torch.Tensor:
    """drop_tokens=False: the largest expert load of any rank of `ep_group` (an all-reduce max of one
    integer over it; none without a group), so that every rank's buffers have the same shape."""
    new_capacity = torch.max(exp_counts)
    if ep_group is not None and ep_group.size > 1:
        new_capacity = new_capacity.clone()
        comm.all_reduce(new_capacity, ep_group, op="max")
    return new_capacity


def _checked_used_token(used_token: torch.Tensor | None, num_tokens: int) -> torch.Tensor | None:
    if used_token is None:
        return None
    if used_token.dtype.is_floating_point or used_token.dtype.is_complex:
        raise TypeError(f"used_token: an integer or bool mask (1: route the token, 0: drop it) of shape "
                        f"({num_tokens},), got dtype {used_token.dtype}")
    if tuple(used_token.shape) != (num_tokens,):
        raise ValueError(f"used_token: shape ({num_tokens},) (one entry per token of the flattened input), got "
                         f"{tuple(used_token.shape)}")
    return used_token.long()


def top1gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, used_token: torch.Tensor | None = None,
               noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group: GroupHandle | None = None) -> Gating:
    """Top-1 gating of `logits` (S, E) fp32, as DeepSpeed's `top1gating`: each token's most probable
    expert (with 'RSample': of the logits plus Gumbel noise), `used_token` (S,) masking tokens out,
    then per expert at most `capacity` tokens, chosen by Random Token Selection when `use_rts`.
    Communicates only with ``drop_tokens=False`` (see `_no_drop_capacity`, over `ep_group`)."""
    S, E = logits.shape
    used_token = _checked_used_token(used_token, S)
    if S < min_capacity:
        raise ValueError(f"min_capacity={min_capacity}: more than the {S} tokens this rank routes (DeepSpeed "
                         f"asserts the same); set min_capacity <= {S} or route more tokens per step")
    noisy = logits + _gumbel(logits.shape, logits.device) if noisy_gate_policy == "RSample" else None
    gates = F.softmax(logits, dim=1)  # (S, E)
    cap = capacity(S, E, capacity_factor, min_capacity)
    indices1 = torch.argmax(noisy if noisy is not None else gates, dim=1)  # (S,)
    mask1 = F.one_hot(indices1, num_classes=E)  # (S, E) int64
    if used_token is not None:
        mask1 = mask1 * used_token.unsqueeze(1)
    exp_counts = torch.sum(mask1, dim=0).detach()
    if not drop_tokens:
        cap = torch.minimum(_no_drop_capacity(exp_counts, ep_group), torch.tensor(S, device=exp_counts.device))
    l_aux = torch.sum(torch.mean(gates, dim=0) * torch.mean(mask1.float(), dim=0)) * E
    keys = mask1 * _uniform(mask1.shape, logits.device, 0.0, 1.0) if use_rts else mask1  # (S, E)
    chosen = torch.topk(keys, k=int(min(cap, torch.tensor(S))), dim=0)[1]  # (min(C, S), E): the kept tokens
    mask1 = mask1 * torch.zeros_like(mask1).scatter_(0, chosen, 1)
    kept = mask1.sum(dim=1) > 0  # (S,)
    locations1 = torch.sum((torch.cumsum(mask1, dim=0) - 1) * mask1, dim=1)  # (S,) slot in the expert's buffer
    gates1 = (gates * mask1).sum(dim=1)  # (S,) the chosen expert's probability, 0 when dropped
    return Gating(l_aux, int(cap), torch.where(kept, indices1, -1).unsqueeze(0), locations1.unsqueeze(0),
                  gates1.unsqueeze(0), exp_counts)


def top2gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: GroupHandle | None = None, top2_2nd_expert_sampling: bool = True) -> Gating:
    """Top-2 gating of `logits` (S, E) fp32, as DeepSpeed's `top2gating`: each token's most probable
    expert, and a second one: the best other logit after adding Gumbel noise when
    `top2_2nd_expert_sampling`; slots are given first choices first, earlier tokens first, and
    routes past `capacity` (computed with 2 · capacity_factor) dropped; the kept weights renormalised.
    `logits` is not modified. Communicates only with ``drop_tokens=False`` (over `ep_group`)."""
    S, E = logits.shape
    gates = F.softmax(logits, dim=1)  # (S, E)
    indices1 = torch.argmax(gates, dim=1)  # (S,)
    mask1 = F.one_hot(indices1, num_classes=E)  # (S, E) int64
    if top2_2nd_expert_sampling:
        logits = logits + _gumbel(logits.shape, logits.device)
    indices2 = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)  # (S,)
    mask2 = F.one_hot(indices2, num_classes=E)
    locations1 = torch.cumsum(mask1, dim=0) - 1  # (S, E)
    locations2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)  # after every first choice
    l_aux = torch.mean(torch.mean(gates, dim=0) * torch.mean(mask1.float(), dim=0)) * E * E
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach()
    if drop_tokens:
        cap = capacity(S, E, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(locations1, cap)
        mask2 = mask2 * torch.lt(locations2, cap)
    else:
        cap = _no_drop_capacity(exp_counts, ep_group)
    locations1_s = torch.sum(locations1 * mask1, dim=1)  # (S,)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    gates1 = (gates * mask1.float()).sum(dim=1)  # (S,) one nonzero term each: exact
    gates2 = (gates * mask2.float()).sum(dim=1)
    denom = torch.clamp(gates1 + gates2, min=torch.finfo(gates1.dtype).eps)
    kept1, kept2 = mask1.sum(dim=1) > 0, mask2.sum(dim=1) > 0
    return Gating(l_aux, int(cap), torch.stack([torch.where(kept1, indices1, -1), torch.where(kept2, indices2, -1)]),
                  torch.stack([locations1_s, locations2_s]), torch.stack([gates1 / denom, gates2 / denom]), exp_counts)


__all__ = ["Gating", "capacity", "multiplicative_jitter", "top1gating", "top2gating"]
