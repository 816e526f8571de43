"""The context-parallel attention core of one transformer block, one micro-batch on one rank (pure: no torch):
what it sends over the cp group (`transfers`, which comm_volume.py counts as megazero's CommStats do) and its
seconds (`cp_core_cost`, which block_cost.py puts in place of the one-rank core). Notation: cp ranks, n = s/cp
tokens per rank in two chunks of c = s/(2·cp), b micro-batch, a_t / kv_t query / KV heads per TP rank, g =
a_t / kv_t, d head dim, w bytes of the training dtype.

Ring (`megazero/context_parallel/ring.py`). The key/value blocks (k and v of one rank, 2·b·kv_t·n·d elements in
the training dtype) go around the cp group: forward cp − 1 sends to the next rank and as many receives from
the previous one; backward the same cp − 1 blocks again plus cp sends (and receives) of the block's fp32
dK/dV partial sums (2·b·kv_t·n·d·4 bytes). A rank computes 2·cp + 1 (query chunk, key chunk) pairs: three
with its own block (two of them on the diagonal, causal), two with every other rank's. On a GPU a pair runs in
fp32 plain PyTorch (`ring._MathPair`; timed as the planner times fp32 GEMMs: the TF32 rate, half the 16-bit
peak): forward QKᵀ over (g·c, c, d) and PV over (g·c, d, c) per KV head, backward QKᵀ again, dV, dP, dQ and dK
(five), plus memory-bound passes over the c x c scores (`FWD_SCORE_BYTES`, `BWD_SCORE_BYTES`). On a CPU (a
calibrated hardware file, ``cores_per_node``) without ALiBi a pair runs torch's fused flash kernel
(`ring._FlashCpuPair`): 4·b·a_t·c²·d FLOPs forward (half on the diagonal) at `flash_fwd`, 2.5x backward at
`flash_bwd`. The passes over a pair's c x d rows (the online-softmax merge, the fp32 copies) are not counted.
The exchange of step j is
posted before step j's pairs and waited after them, so its exposed time is max(0, transfer − the step's
compute); in backward the next block and the previous block's partials share the link during a step, and
the last partials (after the last step) are waited at once. A transfer runs on NVLink when the cp group sits
in one node (cp·tp ranks, tp apart, within gpus_per_node), else at the inter-node rate of the hop that leaves
the node (every hop of a step runs at once; the slowest sets the step).

Ulysses (`megazero/context_parallel/ulysses.py`). Forward four all-to-alls over the cp group (q; k and v
repeated to kv_r heads, the smallest multiple of kv_t that cp divides; the output), backward four of their
gradients, each moving (cp − 1)/cp of its tensor (b·a_t·n·d or b·kv_r·n·d elements, training dtype), not
overlapped (`Machine.all_to_all`: the share for ranks in the node on NVLink, the rest on the inter-node link).
Between them SDPA runs on the whole sequence with a_t/cp heads: flash attention's causal FLOPs at `flash_fwd`
/ `flash_bwd` (2·b·(a_t/cp)·s²·d forward, 2.5x backward), and the index_selects into position order and the
all-to-all buffers' copies read and write each of the four tensors twice (`ULYSSES_COPY_BYTES`).

An MoE layer (megazero/moe/routing.py) makes its load-balancing loss the whole sequence's: forward two
all-reduces over the cp group of (b, E) fp32 (the assignment counts, the router's summed probabilities),
backward one (the probabilities' gradient, `context_parallel.sum_over`).

Recompute (selective: the core; full: the block) runs the core's forward again in backward: its sends too.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from megazero.planner.machine import Machine

FWD_SCORE_BYTES = 40
"""Bytes per score element a ring pair's forward (`ring._MathPair`) reads and writes outside its GEMMs: the scale
(8), the log-sum-exp (its maximum, shifted exponential and sum: 16), the shift by it and the exponential (16),
and on the diagonal the causal mask (spread over the pairs: ~4, not counted)."""

BWD_SCORE_BYTES = 52
"""The same in backward: the scale (8), the shift by the log-sum-exp and its exponential (16), dP − rowsum
(8), dS = P∘(...) (12), dSᵀ made contiguous for the dK GEMM (8)."""

RING_OPS = (16, 20)
"""Operators the ring dispatches per pair (forward, backward), counted from ring.py: what a CPU's host pays
(`Machine.host`, 0 on accelerators)."""

ULYSSES_COPY_BYTES = 4
"""Bytes per element and byte of the dtype the Ulysses core moves around each all-to-all: the send buffer's
contiguous copy and the index_select into (or out of) position order, a read and a write each."""


@dataclass(frozen=True)
class Transfer:
    """`count` operations `op` (``send``, ``recv``, ``all_to_all``) of `numel` elements of `elem` bytes each,
    per block and micro-batch, in the forward (`backward` False) or the backward."""

    op: str
    numel: int
    elem: int
    count: int
    backward: bool


def kv_repeats(kv_t: int, cp: int) -> int:
    """`megazero.context_parallel.ulysses.kv_repeats`: K/V heads are repeated so that cp divides them."""
    return cp // gcd(kv_t, cp)


def _sizes(spec, layout):
    """(b, a_t, kv_t, n, c, d) of one rank."""
    t, cp = layout.tp, layout.cp
    n = spec.seq_len // cp
    return layout.micro_batch, spec.heads // t, spec.num_kv_heads // t, n, n // 2, spec.head_dim


def transfers(spec, layout, w: int) -> list[Transfer]:
    """What one block's core sends and receives over the cp group per micro-batch (module docstring); [] at
    cp 1. The recompute's forward is not in it (comm_volume.py and block_cost.py add it)."""
    cp = layout.cp
    if cp == 1:
        return []
    b, a_t, kv_t, n, _, d = _sizes(spec, layout)
    moe = getattr(spec, "moe", None)
    aux = [] if moe is None else [Transfer("all_reduce", b * moe.num_experts, 4, 2, False),
                                  Transfer("all_reduce", b * moe.num_experts, 4, 1, True)]
    if layout.cp_method == "ring":
        block = 2 * b * kv_t * n * d
        return [Transfer(op, block, w, cp - 1, bwd) for bwd in (False, True) for op in ("send", "recv")] + \
               [Transfer(op, block, 4, cp, True) for op in ("send", "recv")] + aux
    kv_r = kv_t * kv_repeats(kv_t, cp)
    sizes = (b * a_t * n * d, b * kv_r * n * d, b * kv_r * n * d, b * a_t * n * d)  # q, k, v, out
    return [Transfer("all_to_all", numel, w, 1, bwd) for bwd in (False, True) for numel in sizes] + aux


def _ring_link(layout, mc: Machine) -> float:
    """Bytes/s of one ring hop: NVLink when the cp group (cp ranks tp apart) is inside a node."""
    return mc.nvlink if layout.cp * layout.tp <= mc.node else mc.internode


def _pair(spec, layout, mc: Machine) -> tuple[float, float, float]:
    """(forward, backward) seconds of one off-diagonal (query chunk, key chunk) pair and what a diagonal
    (causal) pair costs of it (module docstring)."""
    b, a_t, kv_t, _, c, d = _sizes(spec, layout)
    if getattr(mc.hw, "cores_per_node", 0) and spec.position != "alibi":  # a CPU: the fused flash kernel
        flops = 4.0 * b * a_t * c * c * d
        return mc.flops(flops, mc.eff.flash_fwd), mc.flops(2.5 * flops, mc.eff.flash_bwd), 0.5
    g, batch, scores = a_t // kv_t, b * kv_t, b * a_t * c * c
    fwd = (mc.gemm32(g * c, c, d, batch) + mc.gemm32(g * c, d, c, batch) + mc.mem(FWD_SCORE_BYTES * scores, 6)
           + mc.host(RING_OPS[0]))
    bwd = (2 * mc.gemm32(g * c, c, d, batch) + mc.gemm32(c, d, g * c, batch) + mc.gemm32(g * c, d, c, batch)
           + mc.gemm32(c, d, g * c, batch) + mc.mem(BWD_SCORE_BYTES * scores, 8) + mc.host(RING_OPS[1]))
    return fwd, bwd, 1.0  # the mask saves no work


def _ring(spec, layout, mc: Machine) -> tuple[dict, dict]:
    cp = layout.cp
    b, _, kv_t, _, c, d = _sizes(spec, layout)
    pair_f, pair_b, diagonal = _pair(spec, layout, mc)
    link, lat = _ring_link(layout, mc), mc.eff.collective_us * 1e-6
    block = 2 * b * kv_t * 2 * c * d
    t_kv, t_dkv = lat + block * mc.act / link, lat + block * 4 / link
    steps = [1 + 2 * diagonal] + [2] * (cp - 1)  # pairs per step: the own block's (two diagonal), then two
    fwd_wait = sum(max(0.0, t_kv - k * pair_f) for k in steps[:-1])
    bwd_wait = sum(max(0.0, (t_kv if j < cp - 1 else 0.0) + (t_dkv if j else 0.0) - k * pair_b)
                   for j, k in enumerate(steps)) + t_dkv
    pairs = sum(steps)
    return {"attention": pairs * pair_f, "cp_comm": fwd_wait}, {"attention": pairs * pair_b, "cp_comm": bwd_wait}


def _ulysses(spec, layout, mc: Machine) -> tuple[dict, dict]:
    cp, s = layout.cp, spec.seq_len
    b, a_t, _, _, _, d = _sizes(spec, layout)
    flops = 2.0 * b * (a_t // cp) * s * s * d  # the causal half of the square on a_t/cp heads
    forward = [t for t in transfers(spec, layout, mc.act) if t.op == "all_to_all" and not t.backward]  # q, k, v, out
    moved = sum(t.numel for t in forward)
    a2a = sum(mc.all_to_all((cp - 1) / cp * t.numel * mc.act, cp, layout.tp) for t in forward)
    copies = mc.mem(ULYSSES_COPY_BYTES * mc.act * moved, 8)
    fwd = {"attention": mc.flops(flops, mc.eff.flash_fwd) + copies, "cp_comm": a2a}
    bwd = {"attention": mc.flops(2.5 * flops, mc.eff.flash_bwd) + copies, "cp_comm": a2a}
    return fwd, bwd


def moe_sums_cost(spec, layout, mc: Machine) -> tuple[float, float]:
    """(forward, backward) seconds of an MoE layer's load-balancing all-reduces over the cp group (module
    docstring): latency-bound, not overlapped; 0 at cp 1."""
    sums = [t for t in transfers(spec, layout, mc.act) if t.op == "all_reduce"]
    link = mc.link(layout.tp, layout.cp)
    return tuple(sum(t.count * mc.ring("all_reduce", t.numel * t.elem, layout.cp, link, layout.tp) for t in sums
                     if t.backward == bwd) for bwd in (False, True))


def cp_core_cost(spec, layout, mc: Machine) -> tuple[dict, dict]:
    """({"attention": compute s, "cp_comm": exposed communication s} forward, the same backward) of one block's
    context-parallel core, one micro-batch on one rank (module docstring)."""
    return _ring(spec, layout, mc) if layout.cp_method == "ring" else _ulysses(spec, layout, mc)
