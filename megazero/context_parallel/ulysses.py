"""Ulysses attention (DeepSpeed-Ulysses): trade the sequence split for a head split around the attention core.

Each of the cp ranks holds seq/cp tokens of every head. One all-to-all over the cp group turns that into every
token of heads/cp heads: rank p gets heads [p·h/cp, (p+1)·h/cp) of the whole sequence, gathered rank by rank
(`token_layout.gathered_order`), which an index permutes into position order. The ordinary causal core then runs on
whole sequences, and the inverse all-to-all returns each rank its own tokens of every head. Backward runs the
same two all-to-alls the other way.

With fewer KV heads than cp (grouped-query attention), K and V are repeated to the smallest multiple of their
heads that cp divides, as DeepSpeed does; the query heads must be a multiple of cp.

Communication per call, over `group` (the cp group), per rank: forward three all-to-alls in (q, k, v) and one
out, each moving (cp−1)/cp of its tensor; backward the same four the other way.
"""
from __future__ import annotations

import math

import torch

from megazero.context_parallel import token_layout as layout
from megazero.runtime import comm


def _heads_from_seq(x: torch.Tensor, group: comm.GroupHandle) -> torch.Tensor:
    """(b, h, n, d) this rank's tokens of every head -> (b, h/cp, cp·n, d) every rank's tokens (rank by rank)
    of this rank's heads. One all-to-all over `group`."""
    cp = group.size
    b, h, n, d = x.shape
    send = x.reshape(b, cp, h // cp, n, d).transpose(0, 1).contiguous()  # (cp, b, h/cp, n, d): part p to rank p
    recv = torch.empty_like(send)  # recv[p]: rank p's tokens of my heads
    comm.all_to_all_single(recv, send, group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * n, d)


def _seq_from_heads(y: torch.Tensor, group: comm.GroupHandle) -> torch.Tensor:
    """The inverse of `_heads_from_seq`: (b, h/cp, cp·n, d) -> (b, h, n, d). One all-to-all over `group`."""
    cp = group.size
    b, hl, s, d = y.shape
    send = y.reshape(b, hl, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # (cp, b, h/cp, n, d)
    recv = torch.empty_like(send)  # recv[p]: my tokens of rank p's heads
    comm.all_to_all_single(recv, send, group)
    return recv.transpose(0, 1).reshape(b, cp * hl, s // cp, d)


class _Swap(torch.autograd.Function):
    """`_heads_from_seq` (`to_heads`) or `_seq_from_heads` forward, the other one backward."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return (_heads_from_seq if to_heads else _seq_from_heads)(x, group)

    @staticmethod
    def backward(ctx, grad):
        back = _seq_from_heads if ctx.to_heads else _heads_from_seq
        return back(grad.contiguous(), ctx.group), None, None


def kv_repeats(kv_heads: int, cp: int) -> int:
    """How many times each KV head is repeated so that cp divides their number (1 when it already does)."""
    return cp // math.gcd(kv_heads, cp)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: comm.GroupHandle, seq: int,
                      docs: torch.Tensor | None = None, slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's tokens over the whole sequence by two all-to-alls (module docstring).

    q (b, heads, n, d), k and v (b, kv, n, d): this cp rank's n = seq/cp tokens in `token_layout.positions` order;
    `docs` (b, seq): document ids (attention within a document only) or None; `slopes` (heads,): ALiBi, or
    None. Returns (b, heads, n, d)."""
    cp, heads = group.size, q.shape[1]
    if heads % cp:
        raise ValueError(f"parallel.cp_method=ulysses: the {heads} query heads of a tensor-parallel rank must be a "
                         f"multiple of parallel.cp={cp}; use cp_method=ring")
    reps = kv_repeats(k.shape[1], cp)
    if reps > 1:  # fewer KV heads than cp shares: repeat each (the query heads' grouping is kept)
        k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)  # (b, kv·reps, n, d)
    order = layout.natural_order(seq, cp).to(q.device)
    gathered = layout.gathered_order(seq, cp).to(q.device)

    def whole(x):  # (b, h, n, d) -> (b, h/cp, seq, d) in position order
        return _Swap.apply(x, group, True).index_select(2, order)

    qh, kh, vh = whole(q), whole(k), whole(v)
    hl = heads // cp
    mask = None
    if docs is not None or slopes is not None:
        pos = torch.arange(seq, device=q.device)
        allowed = (pos.view(1, seq) <= pos.view(seq, 1)).unsqueeze(0)  # (1, seq, seq)
        if docs is not None:
            allowed = allowed & (docs.unsqueeze(1) == docs.unsqueeze(2))  # (b, seq, seq)
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, -math.inf)
        mask = mask.unsqueeze(1)  # (b or 1, 1, seq, seq)
        if slopes is not None:  # this rank's heads' slopes
            mine = slopes[group.rank * hl:(group.rank + 1) * hl].float()
            rel = (pos.view(1, seq) - pos.view(seq, 1)).float()
            mask = mask + (mine.view(hl, 1, 1) * rel).to(q.dtype).unsqueeze(0)  # (b or 1, h/cp, seq, seq)
    gqa = kh.shape[1] != qh.shape[1]
    if mask is None:
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=gqa)
    return _Swap.apply(out.index_select(2, gathered), group, False)  # (b, h/cp, seq, d) rank by rank -> mine
