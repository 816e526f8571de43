"""Ring attention: causal attention over a sequence whose tokens are spread over a context-parallel group.

Each of the cp ranks holds seq/cp tokens (`token_layout`: a head and a tail chunk) of q, k and v. The key/value
blocks travel around the group (rank r sends to r+1, receives from r−1): at step j rank r holds the block of
rank r−j, and while it computes its queries against that block the next block is already in flight (posted
before the computation, waited after it). The blocks' partial results are merged exactly by the online
softmax (running maximum, sum and weighted values per query row), so the output equals attention over the
whole sequence within rounding. The mask comes from positions, not from block order: a query attends a key
at a position ≤ its own (and, with packed documents, of the same document); a (query chunk, key chunk) pair
that is wholly masked is skipped, one wholly visible is computed without a mask.

Backward (a `torch.autograd.Function`, flash-attention's formulas: P = exp(S − lse), dV = Pᵀ·dO,
dS = P∘(dO·Vᵀ − rowsum(dO∘O)), dQ = dS·K·scale, dK = dSᵀ·Q·scale) sends the blocks around the ring again
and, with each block, the partial sums of its dK and dV, which arrive back at their owner after cp hops.

Communication per call, over `group` (the cp group), per rank: forward cp−1 sends (and receives) of one
key/value block, 2·b·kv·(s/cp)·d elements in the inputs' dtype; backward the same, plus cp sends of the
block's dK/dV partials, 2·b·kv·(s/cp)·d fp32 elements. On NCCL each exchange is one `batch_isend_irecv`;
elsewhere one isend and one irecv (never gloo's batched form, pytorch#132644).

Grouped-query attention without repeating K/V: the query heads reading one KV head are laid out as extra
rows of it, (b, kv, g·n, d). The block computations run in fp32 in plain PyTorch on any device (no fused
kernel yet: the scores of one chunk pair, (b, kv, g·s/(2cp), s/(2cp)), are materialised, then freed).
"""
from __future__ import annotations

import math

import torch

from megazero.context_parallel import token_layout as layout
from megazero.runtime import comm


class _Ring:
    """The point-to-point exchanges of one rank with its ring neighbours in `group`: `post(send, recv)` sends
    to rank+1 and receives from rank−1 at once and returns what `wait` needs."""

    def __init__(self, group: comm.GroupHandle, device: torch.device):
        self.group = group
        self.next, self.prev = (group.rank + 1) % group.size, (group.rank - 1) % group.size
        self.batched = comm.backend(group, device) == "nccl"

    def post(self, send: torch.Tensor, recv: torch.Tensor):
        if self.batched:
            works = comm.batch_isend_irecv([comm.PeerOp("send", send, self.next),
                                            comm.PeerOp("recv", recv, self.prev)], self.group)
        else:  # two single ops: gloo's batched form can hang
            works = [comm.isend(send, self.next, self.group), comm.irecv(recv, self.prev, self.group)]
        return works, send, recv

    def wait(self, pending) -> torch.Tensor:
        """Wait for both; the received tensor."""
        works, _, recv = pending
        for w in works:
            comm.wait(w, self.group)
        comm.note(self.group, "in", recv)
        return recv


def _grouped(x: torch.Tensor, kv: int) -> torch.Tensor:
    """(b, h, n, d) query-like -> (b, kv, g·n, d): the g = h/kv query heads of each KV head as rows."""
    b, h, n, d = x.shape
    return x.reshape(b, kv, (h // kv) * n, d)


def _ungrouped(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, kv, g·n, d) -> (b, heads, n, d)."""
    b, kv, rows, d = x.shape
    return x.reshape(b, heads, rows * kv // heads, d)


class _Blocks:
    """The masks and biases of one call: positions, documents, ALiBi slopes, for the (query chunk, key chunk)
    pairs. `pairs(src)` lists, for the key/value block of cp rank `src`, each pair to compute as
    (query slice, key slice, additive mask or None)."""

    def __init__(self, seq: int, rank: int, cp: int, heads: int, kv: int, docs, slopes, device):
        self.seq, self.cp, self.heads, self.kv, self.device = seq, cp, heads, kv, device
        self.c = seq // (2 * cp)  # tokens per chunk
        self.rank, self.docs, self.slopes = rank, docs, slopes
        self.q_chunks = layout.chunks_of(rank, cp)

    def pairs(self, src: int):
        c, out = self.c, []
        for a, qk in enumerate(self.q_chunks):
            for b, kk in enumerate(layout.chunks_of(src, self.cp)):
                if kk > qk:
                    continue  # every key after every query
                qs, ks = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
                out.append((a, qs, ks, self._mask(qk, kk)))
        return out

    def _mask(self, qk: int, kk: int):
        """Additive fp32 mask (b or 1, kv or 1, g·c, c) for query chunk qk against key chunk kk, or None."""
        c, g = self.c, self.heads // self.kv
        if kk < qk and self.docs is None and self.slopes is None:
            return None
        qpos = torch.arange(qk * c, (qk + 1) * c, device=self.device)
        kpos = torch.arange(kk * c, (kk + 1) * c, device=self.device)
        allowed = (kpos.view(1, c) <= qpos.view(c, 1)).unsqueeze(0)  # (1, c, c)
        if self.docs is not None:  # (b, seq) document ids: the same document only
            allowed = allowed & (self.docs[:, kpos].unsqueeze(1) == self.docs[:, qpos].unsqueeze(2))  # (b, c, c)
        mask = torch.zeros(allowed.shape, dtype=torch.float32, device=self.device).masked_fill(~allowed, -math.inf)
        mask = mask.unsqueeze(1).unsqueeze(2).expand(-1, 1, g, c, c).reshape(mask.shape[0], 1, g * c, c)
        if self.slopes is not None:  # ALiBi: slope·(k − q) per query head
            rel = (kpos.view(1, c) - qpos.view(c, 1)).float()  # (c, c)
            bias = self.slopes.float().view(self.heads, 1, 1) * rel  # (heads, c, c)
            mask = mask + bias.reshape(self.kv, g * c, c).unsqueeze(0)  # (b or 1, kv, g·c, c)
        return mask


def _scores(q, k, mask, scale):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (b, kv, g·c, c)
    return s if mask is None else s + mask


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, blocks: _Blocks, scale: float):
        ring = _Ring(group, q.device)
        r, cp, kvh = group.rank, group.size, k.shape[1]
        qg = _grouped(q.float(), kvh)  # (b, kv, g·n, d)
        g = q.shape[1] // kvh
        c = blocks.c
        rows = [(qg.view(*qg.shape[:2], g, 2, c, qg.shape[-1])[:, :, :, a].reshape(*qg.shape[:2], g * c, -1))
                for a in range(2)]  # per query chunk: (b, kv, g·c, d)
        m = [torch.full((*x.shape[:-1], 1), -math.inf, device=q.device) for x in rows]
        l = [torch.zeros_like(x) for x in m]
        acc = [torch.zeros_like(x) for x in rows]
        kv = torch.stack([k, v]).contiguous()  # (2, b, kv, n, d): one message per hop
        for j in range(cp):
            pending = ring.post(kv, torch.empty_like(kv)) if j < cp - 1 else None  # the next block, in flight
            kb, vb = kv[0].float(), kv[1].float()
            for a, _, ks, mask in blocks.pairs((r - j) % cp):
                s = _scores(rows[a], kb[:, :, ks], mask, scale)  # (b, kv, g·c, c)
                m_new = torch.maximum(m[a], s.amax(-1, keepdim=True))
                m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)  # a row with nothing visible yet
                p = torch.exp(s - m_safe)
                fix = torch.exp(m[a] - m_safe)
                l[a] = l[a] * fix + p.sum(-1, keepdim=True)
                acc[a] = acc[a] * fix + torch.matmul(p, vb[:, :, ks])
                m[a] = m_new
            if pending is not None:
                kv = ring.wait(pending)
        out_rows = [acc[a] / l[a] for a in range(2)]  # every query sees itself: l > 0
        lse = [m[a] + torch.log(l[a]) for a in range(2)]
        out = torch.stack([x.view(*x.shape[:2], g, c, -1) for x in out_rows], dim=3)  # (b, kv, g, 2, c, d)
        out = _ungrouped(out.reshape(qg.shape), q.shape[1]).to(q.dtype)  # (b, heads, n, d)
        ctx.save_for_backward(q, k, v, out, *lse)
        ctx.group, ctx.blocks, ctx.scale = group, blocks, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse0, lse1 = ctx.saved_tensors
        group, blocks, scale = ctx.group, ctx.blocks, ctx.scale
        ring = _Ring(group, q.device)
        r, cp, kvh, heads = group.rank, group.size, k.shape[1], q.shape[1]
        g, c = heads // kvh, blocks.c

        def rows_of(x):  # (b, heads, n, d) -> per query chunk (b, kv, g·c, d), fp32
            xg = _grouped(x.float(), kvh)
            return [xg.view(*xg.shape[:2], g, 2, c, xg.shape[-1])[:, :, :, a].reshape(*xg.shape[:2], g * c, -1)
                    for a in range(2)]

        qs, dos, outs, lse = rows_of(q), rows_of(dout), rows_of(out), (lse0, lse1)
        delta = [(dos[a] * outs[a]).sum(-1, keepdim=True) for a in range(2)]  # rowsum(dO∘O)
        dq = [torch.zeros_like(x) for x in qs]
        kv = torch.stack([k, v]).contiguous()
        partial = None  # the dK/dV partial sums of the block held, arriving from rank r−1
        for j in range(cp):
            pending = ring.post(kv, torch.empty_like(kv)) if j < cp - 1 else None
            kb, vb = kv[0].float(), kv[1].float()
            dkv = torch.zeros((2, *kb.shape), dtype=torch.float32, device=q.device)  # this rank's part
            for a, _, ks, mask in blocks.pairs((r - j) % cp):
                s = _scores(qs[a], kb[:, :, ks], mask, scale)
                p = torch.exp(s - lse[a])  # (b, kv, g·c, c)
                dkv[1][:, :, ks] += torch.matmul(p.transpose(-1, -2), dos[a])
                ds = p * (torch.matmul(dos[a], vb[:, :, ks].transpose(-1, -2)) - delta[a])
                dq[a] += torch.matmul(ds, kb[:, :, ks]) * scale
                dkv[0][:, :, ks] += torch.matmul(ds.transpose(-1, -2), qs[a]) * scale
            if partial is not None:
                dkv += ring.wait(partial)  # the other ranks' sums for this block
            partial = ring.post(dkv, torch.empty_like(dkv))  # on to rank r+1 (after cp hops: its owner)
            if pending is not None:
                kv = ring.wait(pending)
        dk, dv = ring.wait(partial)  # this rank's own block, summed over every rank's queries
        dq_full = torch.stack([x.view(*x.shape[:2], g, c, -1) for x in dq], dim=3)  # (b, kv, g, 2, c, d)
        dq_full = _ungrouped(dq_full.reshape(*dq_full.shape[:2], g * 2 * c, -1), heads)
        return dq_full.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: comm.GroupHandle, seq: int,
                   docs: torch.Tensor | None = None, slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence (see the module docstring).

    q (b, heads, n, d), k and v (b, kv, n, d): this cp rank's n = seq/cp tokens in `token_layout.positions` order;
    `docs` (b, seq): the document id of every position (packed documents attend only within their own), or
    None; `slopes` (heads,): ALiBi slopes, or None. Returns (b, heads, n, d). Communicates point to point
    around `group` (forward and backward; see the module docstring)."""
    layout.check_divisible(seq, group.size)
    blocks = _Blocks(seq, group.rank, group.size, q.shape[1], k.shape[1], docs, slopes, q.device)
    return _RingAttention.apply(q, k, v, group, blocks, 1.0 / math.sqrt(q.shape[-1]))
