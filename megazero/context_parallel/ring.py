"""Ring attention: causal attention over a sequence whose tokens are spread over a context-parallel group.

Each of the cp ranks holds seq/cp tokens (`token_layout`: a head and a tail chunk) of q, k and v. The key/value
blocks travel around the group (rank r sends to r+1, receives from r−1): at step j rank r holds the block of
rank r−j, and while it computes its queries against that block the next block is already in flight (posted
before the computation, waited after it). Each (query chunk, key chunk) pair gives its output and log-sum-exp;
they are merged exactly by the online softmax, so the output equals attention over the whole sequence within
rounding. The mask comes from positions, not from block order: a query attends a key
at a position ≤ its own (and, with packed documents, of the same document); a (query chunk, key chunk) pair
that is wholly masked is skipped, one wholly visible is computed without a mask.

Backward (a `torch.autograd.Function`, flash-attention's formulas: P = exp(S − lse), dV = Pᵀ·dO,
dS = P∘(dO·Vᵀ − rowsum(dO∘O)), dQ = dS·K·scale, dK = dSᵀ·Q·scale) sends the blocks around the ring again
and, with each block, the partial sums of its dK and dV, which arrive back at their owner after cp hops.

Communication per call, over `group` (the cp group), per rank: forward cp−1 sends (and receives) of one
key/value block, 2·b·kv·(s/cp)·d elements in the inputs' dtype; backward the same, plus cp sends of the
block's dK/dV partials, 2·b·kv·(s/cp)·d fp32 elements. On NCCL each exchange is one `batch_isend_irecv`;
elsewhere one isend and one irecv (never gloo's batched form, pytorch#132644).

A pair is computed by one of two kernels (`_kernel`), both in fp32 with the same (out, lse) contract:
`_FlashCpuPair`, torch's fused flash-attention kernel for CPU, for plain causal attention on CPU; `_MathPair`,
plain PyTorch on any device with any mask (documents, ALiBi; GPUs for now: no fused CUDA kernel is wired yet),
which lays the query heads reading one KV head out as extra rows of it, (b, kv, g·c, d), instead of repeating
K/V, and materialises one pair's scores, (b, kv, g·c, c) with c = s/(2cp), at a time.
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


class _Blocks:
    """The masks and biases of one call: positions, documents, ALiBi slopes, for the (query chunk, key chunk)
    pairs. `pairs(src)` lists, for the key/value block of cp rank `src`, each pair to compute as
    (query chunk index, key slice, causal, mask): `causal` when the two chunks are the same positions; `mask`
    is None for a pair of plain causal attention (documents and ALiBi need one: `mask_of`)."""

    def __init__(self, seq: int, rank: int, cp: int, heads: int, kv: int, docs, slopes, device):
        self.seq, self.cp, self.heads, self.kv, self.device = seq, cp, heads, kv, device
        self.c = seq // (2 * cp)  # tokens per chunk
        self.rank, self.docs, self.slopes = rank, docs, slopes
        self.q_chunks = layout.chunks_of(rank, cp)
        self.plain = docs is None and slopes is None  # causal attention alone: no mask tensor needed

    def pairs(self, src: int):
        c, out = self.c, []
        for a, qk in enumerate(self.q_chunks):
            for b, kk in enumerate(layout.chunks_of(src, self.cp)):
                if kk > qk:
                    continue  # every key after every query
                mask = None if self.plain else self.mask_of(qk, kk)
                out.append((a, slice(b * c, (b + 1) * c), kk == qk, mask))
        return out

    def mask_of(self, qk: int, kk: int) -> torch.Tensor:
        """Additive fp32 mask (b or 1, heads or 1, c, c) for query chunk qk against key chunk kk."""
        c = self.c
        qpos = torch.arange(qk * c, (qk + 1) * c, device=self.device)
        kpos = torch.arange(kk * c, (kk + 1) * c, device=self.device)
        allowed = (kpos.view(1, c) <= qpos.view(c, 1)).unsqueeze(0)  # (1, c, c)
        if self.docs is not None:  # (b, seq) document ids: the same document only
            allowed = allowed & (self.docs[:, kpos].unsqueeze(1) == self.docs[:, qpos].unsqueeze(2))  # (b, c, c)
        mask = torch.zeros(allowed.shape, dtype=torch.float32, device=self.device).masked_fill(~allowed, -math.inf)
        mask = mask.unsqueeze(1)  # (b or 1, 1, c, c)
        if self.slopes is not None:  # ALiBi: slope·(k − q) per query head
            rel = (kpos.view(1, c) - qpos.view(c, 1)).float()  # (c, c)
            mask = mask + (self.slopes.float().view(self.heads, 1, 1) * rel).unsqueeze(0)  # (b or 1, heads, c, c)
        return mask


def _grouped(x: torch.Tensor, kv: int) -> torch.Tensor:
    """(b, h, c, d) query-like -> (b, kv, g·c, d): the g = h/kv query heads of each KV head as rows."""
    b, h, c, d = x.shape
    return x.reshape(b, kv, (h // kv) * c, d)


def _grouped_mask(causal, mask, heads, kv, c, device):
    """A pair's additive mask in the grouped layout (·, kv or 1, g·c, c), or None (every key visible)."""
    g = heads // kv
    if mask is None:
        if not causal:
            return None
        above = torch.ones(c, c, dtype=torch.bool, device=device).triu(1)
        mask = torch.zeros(c, c, device=device).masked_fill(above, -math.inf).view(1, 1, c, c)
    lead, per_head = mask.shape[0], mask.shape[1]
    if per_head == 1:  # the same for every head
        return mask.unsqueeze(2).expand(lead, 1, g, c, c).reshape(lead, 1, g * c, c)
    return mask.reshape(lead, kv, g * c, c)  # per head (ALiBi): query head kv_head·g + j


def _scores(q, k, mask, scale):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (b, kv, g·c, c)
    return s if mask is None else s + mask


class _MathPair:
    """One (query chunk, key chunk) pair in plain PyTorch, fp32, on any device: grouped-query attention without
    repeating K/V (the query heads of each KV head as rows), any additive mask. The scores (b, kv, g·c, c) are
    materialised for the pair, then freed."""

    @staticmethod
    def forward(q, k, v, causal, mask, scale):
        """q (b, h, c, d), k and v (b, kv, c, d), fp32 -> (out (b, h, c, d), lse (b, h, c)); a row that sees no
        key gets out 0 and lse −inf."""
        b, h, c, d = q.shape
        kv = k.shape[1]
        s = _scores(_grouped(q, kv), k, _grouped_mask(causal, mask, h, kv, c, q.device), scale)  # (b, kv, g·c, c)
        lse = torch.logsumexp(s, dim=-1, keepdim=True)  # (b, kv, g·c, 1)
        p = torch.exp(s - lse.masked_fill(lse == -math.inf, 0.0))
        return torch.matmul(p, v).reshape(b, h, c, d), lse.reshape(b, h, c)

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, mask, scale):
        """The pair's (dq, dk, dv), fp32, given the whole attention's `out` and `lse` (flash-attention's
        backward: P = exp(S − lse), dV = Pᵀ·dO, dS = P∘(dO·Vᵀ − rowsum(dO∘O)), dQ = dS·K·scale, dK = dSᵀ·Q·scale)."""
        b, h, c, d = q.shape
        kv = k.shape[1]
        qg, dog = _grouped(q, kv), _grouped(dout, kv)
        s = _scores(qg, k, _grouped_mask(causal, mask, h, kv, c, q.device), scale)
        p = torch.exp(s - lse.reshape(b, kv, -1, 1))  # (b, kv, g·c, c)
        delta = (dog * _grouped(out, kv)).sum(-1, keepdim=True)  # rowsum(dO∘O)
        dv = torch.matmul(p.transpose(-1, -2), dog)
        ds = p * (torch.matmul(dog, v.transpose(-1, -2)) - delta)
        dq = torch.matmul(ds, k) * scale
        dk = torch.matmul(ds.transpose(-1, -2), qg) * scale
        return dq.reshape(b, h, c, d), dk, dv


class _FlashCpuPair:
    """One pair through torch's fused flash-attention kernel for CPU (no scores materialised), for plain causal
    attention (no documents, no ALiBi): K/V repeated to the query heads for the call, their gradients summed
    back over each group. Returns and takes the same as `_MathPair`."""

    @staticmethod
    def forward(q, k, v, causal, mask, scale):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # (b, h, c, d)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, mask, scale):
        b, h, c, d = q.shape
        kv = k.shape[1]
        g = h // kv
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), out, lse, 0.0, causal, scale=scale)
        return dq, dk.view(b, kv, g, c, d).sum(2), dv.view(b, kv, g, c, d).sum(2)


def _kernel(blocks: _Blocks, q: torch.Tensor):
    """The pair computation: torch's fused CPU flash kernel for plain causal attention on CPU, else plain
    PyTorch (documents, ALiBi, other devices: no fused kernel is wired for them yet)."""
    return _FlashCpuPair if blocks.plain and q.device.type == "cpu" else _MathPair


def _merge(out, lse, o, l):
    """Online softmax: fold a pair's (o, l) into the running (out, lse) of its query chunk; rows that have seen
    no key yet (lse −inf) take the pair's as they are."""
    new = torch.logaddexp(lse, l)
    safe = new.masked_fill(new == -math.inf, 0.0)
    return out * torch.exp(lse - safe).unsqueeze(-1) + o * torch.exp(l - safe).unsqueeze(-1), new


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, blocks: _Blocks, scale: float):
        ring, kernel = _Ring(group, q.device), _kernel(blocks, q)
        r, cp, c = group.rank, group.size, blocks.c
        qs = [x.float().contiguous() for x in q.split(c, dim=2)]  # per query chunk (b, h, c, d)
        out = [torch.zeros_like(x) for x in qs]
        lse = [torch.full(x.shape[:3], -math.inf, device=q.device) for x in qs]  # (b, h, c)
        kv = torch.stack([k, v]).contiguous()  # (2, b, kv, n, d): one message per hop
        for j in range(cp):
            pending = ring.post(kv, torch.empty_like(kv)) if j < cp - 1 else None  # the next block, in flight
            kb, vb = kv[0].float(), kv[1].float()
            for a, ks, causal, mask in blocks.pairs((r - j) % cp):
                o, l = kernel.forward(qs[a], kb[:, :, ks].contiguous(), vb[:, :, ks].contiguous(), causal, mask, scale)
                out[a], lse[a] = _merge(out[a], lse[a], o, l)
            if pending is not None:
                kv = ring.wait(pending)
        full, lse_full = torch.cat(out, dim=2), torch.cat(lse, dim=2)  # every query sees itself: lse finite
        ctx.save_for_backward(q, k, v, full, lse_full)
        ctx.group, ctx.blocks, ctx.scale = group, blocks, scale
        return full.to(q.dtype)  # (b, heads, n, d)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, blocks, scale = ctx.group, ctx.blocks, ctx.scale
        ring, kernel = _Ring(group, q.device), _kernel(blocks, q)
        r, cp, c = group.rank, group.size, blocks.c

        def chunks(x):  # (b, h, n, ...) -> its two query chunks
            return [t.contiguous() for t in x.split(c, dim=2)]

        qs, dos, outs, lses = chunks(q.float()), chunks(dout.float()), chunks(out), chunks(lse)
        dq = [torch.zeros_like(x) for x in qs]
        kv = torch.stack([k, v]).contiguous()
        partial = None  # the dK/dV partial sums of the block held, arriving from rank r−1
        for j in range(cp):
            pending = ring.post(kv, torch.empty_like(kv)) if j < cp - 1 else None
            kb, vb = kv[0].float(), kv[1].float()
            dkv = torch.zeros((2, *kb.shape), dtype=torch.float32, device=q.device)  # this rank's part
            for a, ks, causal, mask in blocks.pairs((r - j) % cp):
                dqa, dka, dva = kernel.backward(dos[a], qs[a], kb[:, :, ks].contiguous(), vb[:, :, ks].contiguous(),
                                                outs[a], lses[a], causal, mask, scale)
                dq[a] += dqa
                dkv[0][:, :, ks] += dka
                dkv[1][:, :, ks] += dva
            if partial is not None:
                dkv += ring.wait(partial)  # the other ranks' sums for this block
            partial = ring.post(dkv, torch.empty_like(dkv))  # on to rank r+1 (after cp hops: its owner)
            if pending is not None:
                kv = ring.wait(pending)
        dk, dv = ring.wait(partial)  # this rank's own block, summed over every rank's queries
        return torch.cat(dq, dim=2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


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
