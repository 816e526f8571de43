"""The cost of one transformer block and of the embedding and head, one micro-batch on one TP rank
(pure: no torch), as the step-time model (speed.py, whose docstring states the model) times them;
an MoE block's MLP from moe_cost.py. With context parallelism every token-wise term is over this rank's
b·s/cp tokens and the attention core is cp_cost.py's (ring or Ulysses, its exposed sends as ``cp_comm``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megazero.planner.cp_cost import cp_core_cost, moe_sums_cost
from megazero.planner.machine import Implementation, Machine, add_parts
from megazero.planner.moe_cost import moe_cost
from megazero.planner.moe_plan import moe_shape


@dataclass(frozen=True)
class BlockCost:
    """Seconds of one block, one micro-batch (parts dicts by breakdown category), and its parameters."""

    fwd: dict       # forward
    bwd: dict       # input-grad side of backward: dgrad GEMMs, core and elementwise backward
    wgrad: dict     # weight-grad GEMMs and the fp32 accumulation
    tp_bwd: float   # backward collectives, all exposed (weight GEMMs deferred to W, or no overlap)
    tp_bwd_overlapped: float  # the same, hidden behind the GEMMs where megazero does so
    recompute: float  # time of the recompute forward added to each backward (its compute)
    params: float   # GEMM weights of the block on this TP rank (an MoE MLP's router and shared experts too)
    expert_params: float = 0.0  # an MoE MLP's routed experts on this rank (their own data-parallel group)
    recompute_comm: dict = field(default_factory=dict)  # that forward's collectives (full recompute): parts


def block_gemms(spec, t: int, impl: Implementation):
    """(region, out, in) of the block's linear layers on one TP rank; region: the column region
    (attn, mlp) whose backward reduction its weight GEMMs can hide, None for the row-parallel ones. An
    MoE block's MLP is not among them (moe_cost.py)."""
    d, a, g, f = spec.head_dim, spec.heads // t, spec.num_kv_heads // t, spec.ffn // t
    h = spec.hidden
    if impl.fused_qkv:
        attn = [("attn", (a + 2 * g) * d, h)]
    else:
        attn = [("attn", a * d, h), ("attn", g * d, h), ("attn", g * d, h)]
    if spec.moe is not None:
        return attn + [(None, h, a * d)]
    mlp_in = [("mlp", f, h)] * (2 if spec.activation == "swiglu" else 1)
    return attn + [(None, h, a * d)] + mlp_in + [(None, h, f)]


def _attention(spec, layout, mc: Machine) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core of one micro-batch on one TP rank."""
    b, s, d = layout.micro_batch, spec.seq_len, spec.head_dim
    bh = b * spec.heads // layout.tp
    if spec.attention_dropout == 0:  # SDPA flash: the causal half of the square
        flops = 2.0 * bh * s * s * d
        return mc.flops(flops, mc.eff.flash_fwd), mc.flops(2.5 * flops, mc.eff.flash_bwd)
    scores = bh * s * s
    dropout = (2 * mc.act + 1) * scores  # read, write, 1-byte mask; the same backward
    fwd = mc.gemm(s, s, d, bh) + mc.gemm(s, d, s, bh) + mc.mem(2 * mc.act * scores + dropout, 2)  # QKᵀ, PV, softmax
    bwd = mc.gemm(s, s, d, bh) + 3 * mc.gemm(s, d, s, bh) + mc.mem(3 * mc.act * scores + dropout, 2)  # dP, dV, dQ, dK
    return fwd, bwd


def _elementwise(spec, layout, mc: Machine) -> float:
    """Bytes the forward's memory-bound kernels move: two norms (4 B per (s, b, h) element), two residual
    adds (6, and 1 more for a dropout mask), the MLP activation (4 B, SwiGLU 6, per (s, b, f/t)
    element; an MoE MLP's in moe_cost.py), RoPE on q and k (4 B per element)."""
    t, tokens = layout.tp, layout.micro_batch * spec.seq_len // layout.cp
    x = tokens * spec.hidden / (t if layout.sequence_parallel else 1)
    y = tokens * spec.ffn / t if spec.moe is None else 0
    act = (3 if spec.activation == "swiglu" else 2) * mc.act * y
    rope = 2 * mc.act * tokens * spec.head_dim * (spec.heads + spec.num_kv_heads) / t if spec.position == "rope" else 0
    return (2 * 2 * mc.act + 2 * (3 * mc.act + (1 if spec.dropout > 0 else 0))) * x + act + rope


HOST_OPS = {"learned": (81, 167), "rope": (126, 135)}
"""Operators megazero dispatches for one transformer block and micro-batch on its CPU path, (forward, backward),
by position kind (the GPT block; the Llama block with RoPE, RMSNorm and SwiGLU): counted with a dispatch mode
(tests/test_planner_speed.py checks them against a count). Selective recompute adds SELECTIVE_OPS to backward;
full recompute repeats the forward's."""
SELECTIVE_OPS = 25
HEAD_OPS = 140
"""Operators of the embedding, the head and the loss for one micro-batch (the same count)."""


def accumulate_bytes(layout, mc: Machine) -> int:
    """Bytes per parameter and micro-batch that megazero moves to accumulate a weight gradient: autograd's
    gradient read (the working dtype) and the fp32 buffer read and written (`FlatGroup.grad_view`); at ZeRO
    2-3 the bucket slot is zeroed first (4) and divided in place before its reduction (8)."""
    return mc.act + 8 + (12 if layout.zero >= 2 else 0)


def host_ops(spec, layout) -> tuple[float, float, float]:
    """(forward, backward, recompute) operators of one block and micro-batch (`HOST_OPS`)."""
    fwd, bwd = HOST_OPS.get(spec.position, HOST_OPS["learned"])
    return fwd, bwd, {"full": fwd, "selective": SELECTIVE_OPS}.get(layout.recompute, 0)


def block_cost(spec, layout, mc: Machine, impl: Implementation) -> BlockCost:
    """The `BlockCost` of one block of `spec` (speed.py's model; an MoE MLP's as moe_cost.py's, its
    backward TP all-reduces exposed)."""
    t, tokens = layout.tp, layout.micro_batch * spec.seq_len // layout.cp
    shape = moe_shape(spec, layout)
    gemms = block_gemms(spec, t, impl)
    fwd_gemm = sum(mc.gemm(tokens, out, inp) for _, out, inp in gemms)
    dgrad = {r: sum(mc.gemm(tokens, inp, out) for rr, out, inp in gemms if rr == r) for r in ("attn", "mlp", None)}
    wgrad = {r: sum(mc.gemm(out, inp, tokens) for rr, out, inp in gemms if rr == r) for r in ("attn", "mlp", None)}
    params = sum(out * inp for _, out, inp in gemms)
    if layout.cp > 1:  # ring or Ulysses: {"attention", "cp_comm"} forward and backward
        core_f, core_b = cp_core_cost(spec, layout, mc)
    else:
        core_f, core_b = ({"attention": x} for x in _attention(spec, layout, mc))
    elem = _elementwise(spec, layout, mc)
    # TP: two all-reduces of (s, b, h) forward and two backward; sequence parallelism: an all-gather
    # and a reduce-scatter (each half an all-reduce's time) per all-reduce, plus backward's re-gather
    # of each column region's saved input shard for its weight GEMMs
    ar = mc.ring("all_reduce", tokens * spec.hidden * mc.act, t, mc.link(1, t))
    regions = ("attn", "mlp") if shape is None else ("attn",)
    if layout.sequence_parallel:  # row grads all-gathered (exposed); column grads reduce-scattered
        half = ar / 2            # behind the weight GEMMs, the shard re-gathered behind the input GEMMs
        exposed = 6 * half
        hidden = 2 * half + sum(max(0.0, half - wgrad[r]) + max(0.0, half - dgrad[r]) for r in regions)
    else:
        exposed = len(regions) * ar
        hidden = sum(max(0.0, ar - wgrad[r]) for r in regions)
    ops_f, ops_b, ops_r = host_ops(spec, layout)
    fwd = add_parts({"gemm": fwd_gemm, "elementwise": mc.mem(elem, 6) + mc.host(ops_f),
                     "tp_comm": len(regions) * ar}, core_f)
    comm = ("tp_comm", "cp_comm")
    recompute = {"full": sum(v for k, v in fwd.items() if k not in comm),
                 "selective": core_f["attention"] + mc.host(ops_r)}.get(layout.recompute, 0.0)
    recompute_comm = {"full": {k: v for k, v in fwd.items() if k in comm},  # the recompute forward's sends
                      "selective": {k: v for k, v in core_f.items() if k in comm}}.get(layout.recompute, {})
    bwd = add_parts({"gemm": sum(dgrad.values()), "elementwise": mc.mem(2 * elem, 8) + mc.host(ops_b)}, core_b)
    wgrad_parts = {"gemm": sum(wgrad.values()), "elementwise": mc.mem(accumulate_bytes(layout, mc) * params, len(gemms))}
    if shape is None:
        return BlockCost(fwd=fwd, bwd=bwd, wgrad=wgrad_parts, tp_bwd=exposed,
                         tp_bwd_overlapped=hidden if impl.tp_overlap else exposed, recompute=recompute,
                         params=params, recompute_comm=recompute_comm)
    moe = moe_cost(shape, layout, mc)
    moe_tp = moe.bwd.get("tp_comm", 0.0)
    sums_f, sums_b = moe_sums_cost(spec, layout, mc)  # context parallel: the load-balancing sums over cp
    if sums_f or sums_b:
        moe = dataclasses.replace(moe, fwd=add_parts(moe.fwd, {"cp_comm": sums_f}),
                                  bwd=add_parts(moe.bwd, {"cp_comm": sums_b}),
                                  recompute_comm=add_parts(moe.recompute_comm, {"cp_comm": sums_f}))
    return BlockCost(fwd=add_parts(fwd, moe.fwd), bwd=add_parts(bwd, {k: v for k, v in moe.bwd.items() if k != "tp_comm"}),
                     wgrad=add_parts(wgrad_parts, moe.wgrad), tp_bwd=exposed + moe_tp,
                     tp_bwd_overlapped=(hidden if impl.tp_overlap else exposed) + moe_tp,
                     recompute=recompute + (moe.recompute if layout.recompute == "full" else 0.0),
                     params=params + moe.dense_params, expert_params=moe.expert_params,
                     recompute_comm=add_parts(recompute_comm, moe.recompute_comm if layout.recompute == "full" else {}))


def embedding_head_cost(spec, layout, mc: Machine) -> tuple[dict, ...]:
    """(embedding forward, embedding backward, head forward, head input-grad, head weight-grad) as
    parts dicts (category embedding_head; their collectives tp_comm) for one micro-batch on one TP rank. The
    vocabulary-parallel embedding all-reduces its output; the head's input grad is all-reduced (f); the loss all-reduces
    three fp32 values per token; the logits cost 10 bytes per element forward and 6 backward (the
    16-bit logits read, fp32 softmax statistics, the 16-bit grad written)."""
    t, tokens, h = layout.tp, layout.micro_batch * spec.seq_len // layout.cp, spec.hidden
    vocab = spec.padded_vocab(t) // t
    x = tokens * h
    ar = mc.ring("all_reduce", x * mc.act, t, mc.link(1, t))
    pos = 3 * mc.act * x if spec.position == "learned" else 0
    emb_f = mc.mem(2 * mc.act * x + pos, 2) + mc.host(HEAD_OPS / 2)
    emb_b = mc.mem(4 * mc.act * x + 4 * vocab * h, 2)  # scatter-add into the (dense, fp32) table gradient
    logits = tokens * vocab
    loss_ar = 3 * mc.ring("all_reduce", 4 * tokens, t, mc.link(1, t))
    head_f = mc.gemm(tokens, vocab, h) + mc.mem(4 * mc.act * x + 10 * logits, 4)
    head_b = mc.gemm(tokens, h, vocab) + mc.mem(6 * logits + 8 * mc.act * x, 4) + mc.host(HEAD_OPS / 2)
    head_w = mc.gemm(vocab, h, tokens) + mc.mem(10 * vocab * h)
    comm = {"tp_comm": ar} if t > 1 else {}  # apart from compute: a CPU counts their CPU time at comm_cpu
    return ({"embedding_head": emb_f, **comm}, {"embedding_head": emb_b},
            {"embedding_head": head_f, **({"tp_comm": loss_ar} if t > 1 else {})},
            {"embedding_head": head_b, **comm}, {"embedding_head": head_w})
