"""What a context-parallel attention keeps for backward, and what its core's backward holds while it runs, per
micro-batch on one rank (pure: no torch); part of activation_ledger.py's ledger (same notation: w bytes of the
training dtype, b micro-batch, a_t / kv_t query / KV heads per TP rank, d head dim).

With cp ranks (`Layout.cp`) each rank holds n = s/cp tokens of every sequence (a head and a tail chunk of
c = s/(2·cp) tokens, `megazero.context_parallel.token_layout`), so every token-wise tensor of the ledger is n
long (activation_ledger.dims puts n in place of s). The attention layer (megazero/models/attention.py) then
differs from the one-rank layer in three places:

* RoPE rotates this rank's tokens by their own positions: cos and sin indexed by them, (n, d) each in w bytes,
  new tensors in every layer (one storage per stage without cp), kept by the rotation's multiplies.
* The core, ``parallel.cp_method``:
  - ring (`context_parallel/ring.py`, an autograd Function): keeps its inputs q, k, v (the rotated q, k and
    the view of v's GEMM output), its merged output in fp32 (4·b·a_t·n·d; returned as it is when w = 4, else
    as a w-byte copy) and its fp32 log-sum-exp (4·b·a_t·n).
  - ulysses (`context_parallel/ulysses.py`): the all-to-alls keep nothing; each of q, k, v is gathered to
    (b, heads/cp, s, d) and put in position order by an index_select, which keeps the order (int64, 8·s,
    one per layer for the three), and SDPA runs on the whole sequence with heads/cp heads: it keeps the
    gathered q (w·b·a_t·n·d), k and v (w·b·kv_r·n·d each, kv_r = kv_t repeated to the smallest multiple
    that cp divides, `ulysses.kv_repeats`), its output and its log-sum-exp (activation_ledger._fused_extras
    on those sizes: 4·b·a_t·n, CUDA's memory-efficient kernel padding s to 32; SDPA's math kernel for
    ALiBi's float mask on a CPU: activation_ledger._explicit_core); the output's index_select back to
    rank-by-rank order keeps its index (8·s).
* The out GEMM keeps the core's output rearranged to (n, b, a_t·d): a copy (w·b·a_t·n·d) unless a_t = 1 or
  n = 1 (then a view of the core's output: the ring's fp32 output itself when w = 4).

Selective recompute keeps q, k, v (the region's anchor) and rebuilds the core: the loaded copies of q, k, v
(`activation_ledger._contiguous`) and everything the core keeps, as for the one-rank core.

`core_working` is what the core's backward holds beyond the tensors kept for it, at its largest (counted as
a transient of the stage, `Chunk.core`), counted from the code's buffers and checked against LiveTensorBytes
around one core's backward on gloo ranks (tests/test_planner_cp.py):

* ring: per (query chunk, key chunk) pair, in fp32; c = n/2, K = b·kv_t·n·d. Around the pairs: the incoming
  gradient (w·b·a_t·n·d); q, the output gradient and the saved output cut into contiguous fp32 query chunks
  and dQ (4 · 4·b·a_t·n·d); the log-sum-exp's chunks (4·b·a_t·n); the key/value block held and, but at the
  last of cp = 2's steps, the one arriving (2·w·K each) and their fp32 copies (2·4·K when w != 4); this
  block's dK/dV, the previous block's being sent and the receive buffer (3 · 2·4·K); the pair's key and
  value chunks made contiguous (2·4·K/2, unless b·kv_t = 1). Inside a pair, on a GPU (plain PyTorch,
  `ring._MathPair`): four score-sized tensors (4·b·a_t·c² each: the scores, P, dS and the contiguous copy
  of dSᵀ the dK GEMM reads) beside the pair's dQ (4·b·a_t·c·d), dV and dK with its scaled copy (3 · 4·K/2)
  and rowsum(dO∘O) (4·b·a_t·c); on a CPU without ALiBi (torch's fused flash kernel, `ring._FlashCpuPair`):
  K and V repeated to the query heads, the kernel's dq, dk, dv and one more buffer of the same size (6 ·
  4·b·a_t·c·d) and the summed dK, dV (2 · 4·K/2). Measured on gloo ranks with LiveTensorBytes around one
  core's backward, both paths (the GPU's forced on a CPU), cp 2 and 4, fp32 and bf16, g = 1, 2 and 16: equal
  to the byte.
* ulysses: the incoming gradient (a permuted view, copied contiguous for the all-to-all) and, around SDPA's
  backward, its dq, dk, dv and the position-ordered output gradient (w·b·(4·a_t + 2·kv_r)·n·d in all).
"""
from __future__ import annotations

from dataclasses import replace


def kv_repeated(c) -> int:
    """KV heads per TP rank after Ulysses' repeat (`megazero.context_parallel.ulysses.kv_repeats`)."""
    from math import gcd

    return c.kv_t * (c.cp // gcd(c.kv_t, c.cp))


def inner_dims(c):
    """The sizes of Ulysses' SDPA: the whole sequence on heads/cp query heads and kv_r/cp KV heads."""
    return replace(c, s=c.seq, a_t=c.a_t // c.cp, kv_t=kv_repeated(c) // c.cp, cp=1)


def rope_tables(L, c, p: str) -> None:
    """cos and sin at this rank's positions, (n, d) each, kept by the rotation of q and k."""
    L.save(p + ".rope.cos", c.s * c.d * c.w)
    L.save(p + ".rope.sin", c.s * c.d * c.w)


def _core(L, c, p: str, extras, explicit) -> None:
    """The tensors the core keeps beyond its inputs (ring) or instead of them (ulysses)."""
    if c.cp_method == "ring":
        L.save(p + ".ring.o", 4 * c.b * c.a_t * c.s * c.d)  # the merged output, fp32
        L.save(p + ".ring.lse", 4 * c.b * c.a_t * c.s)
        return
    inner = inner_dims(c)
    L.save(p + ".order", 8 * c.seq)
    if c.alibi and not c.cuda:  # SDPA's math kernel for a float mask on a CPU
        explicit(L, inner, p + ".u", rebuilt=False)
    else:
        for name, n in [(p + ".u.q", inner.q_bytes), (p + ".u.k", inner.kv_bytes),
                        (p + ".u.v", inner.kv_bytes)] + extras(inner, p + ".u"):
            L.save(name, n)
    L.save(p + ".gathered", 8 * c.seq)


def cp_attention(L, c, p: str, policy: str, qkv, copies: int, extras, explicit, new_ledger) -> None:
    """Into ledger `L`, what the attention of block `p` keeps under `policy` with context parallelism, after
    the q, k, v GEMMs (see the module docstring). `qkv`: ((name, bytes)) of q, k, v as the core receives
    them; `copies`: bytes of the selective recompute's loaded copies of them; `extras`, `explicit`,
    `new_ledger`: activation_ledger's `_fused_extras`, `_explicit_core` and `_Ledger`."""
    if c.rope:
        rope_tables(L, c, p)
    if policy == "selective":  # the region's anchor keeps q, k, v; the core is rebuilt in backward
        for name, n in qkv:
            L.save(name, n)
        region = new_ledger()  # the loaded copies (the ring keeps them; Ulysses' all-to-all reads them) and the core
        _core(region, c, p, extras, explicit)
        L.region(copies + region.saved)
    else:
        if c.cp_method == "ring":
            for name, n in qkv:
                L.save(name, n)
        _core(L, c, p, extras, explicit)
    view = c.a_t == 1 or c.s == 1  # the (n, b, a_t·d) rearrangement of the core's output is a view of it
    L.save(p + ".ring.o" if view and c.cp_method == "ring" and c.w == 4 else p + ".ctx", c.q_bytes)


def core_working(c) -> int:
    """Bytes the context-parallel core's backward holds beyond the tensors kept for it (module docstring)."""
    if c.cp_method == "ulysses":
        return c.q_bytes + 3 * c.q_bytes + 2 * c.b * kv_repeated(c) * c.s * c.d * c.w
    q32, lse = 4 * c.b * c.a_t * c.s * c.d, 4 * c.b * c.a_t * c.s
    kv, chunk = c.b * c.kv_t * c.s * c.d, c.s // 2  # K: elements of k (or v) on this rank
    blocks = 2 if c.cp > 2 else 1  # held, and arriving (every step but the last posts the next)
    around = (4 * q32 + lse + blocks * 2 * kv * c.w + (2 * kv * 4 if c.w != 4 else 0) + 3 * 2 * kv * 4
              + (4 * kv if c.b * c.kv_t > 1 else 0))
    if not c.cuda and not c.alibi:  # torch's fused CPU flash kernel per pair
        pair = 6 * q32 // 2 + 2 * 2 * kv
    else:  # plain PyTorch: the pair's scores materialised
        pair = 4 * 4 * c.b * c.a_t * chunk * chunk + q32 // 2 + 3 * 2 * kv + lse // 2
    return c.q_bytes + around + pair
