"""What a Mixture-of-Experts MLP keeps for backward, per micro-batch on one rank (pure: no torch); part of
activation_ledger.py's ledger (same notation: s, b, h, w bytes of the training dtype).

A Mixture-of-Experts MLP (megazero/moe/layer.py, routing.py, dispatch.py, experts.py; R = s·b tokens, E
experts, top k, N the rows this rank keeps and sends, M the rows its experts run, both from moe_plan.py's
balanced assumption; f_e, f_sh the routed and shared experts' widths on this TP rank): the tokens (R, h), a
copy of the norm output unless b = 1 (then a view of it), kept by the router GEMM (w = 4), or in
16-bit its fp32 copy (4·R·h) and the router weight's (4·E·h); routing in fp32 (the discrete
decision is made without autograd): the scores (4·R·E), the chosen experts' index their weights
are gathered at (8·R·k), with normalize_topk and k > 1 the gathered scores and their sum
(4·R·k + 4·R), the per-sequence assignment fractions (4·b·E), sigmoid scores' row sums (4·R), the
logits and their logsumexp for the z-loss (4·R·E + 4·R). With one ep rank every assignment has a row
(the dropped ones after the counts, so that no host synchronisation sizes anything): N = M = R·k
rows below. The rows' token index (8·N); the rows the experts read: gathered (w·N·h, ep = 1; with a
capacity, masked, and the (N, 1) bool mask of the counted rows, N bytes) or, with ep > 1, the received
rows regrouped by expert (w·M·h) and the regrouping (8·M). The experts, as grouped GEMMs
(`megazero.core.moe_spec.grouped_gemm_fits`): their int32 offsets (4·E/P) and their intermediates as
the dense MLP's (SwiGLU 4, GeLU 2, ReLU 1 times w·M·f_e; f_e = f / t_e under expert tensor
parallelism, whose f and g keep nothing); padded instead (the fallback): the rows' place in the
padding (8·M), the padded rows ((E/P·C + 1)·h·w, C = the balanced rows per expert) and the
intermediates over E/P·C rows. With biases, each row's expert (8·M: the biases are gathered per
row). With ep > 1 the regrouping's inverse (8·M). The slot index (8·N), the routing weights (w·N)
and the expert outputs (w·N·h) (the combine, `megazero.moe.layer.combine`, keeps only the token and
slot indices, already counted); the shared experts keep the tokens (w·R·h) and their own
intermediates over R rows.
"""
from __future__ import annotations

from megazero.core.moe_spec import grouped_gemm_fits


def intermediates(activation: str) -> int:
    """(rows, ffn) tensors an MLP keeps: SwiGLU gate, up, silu(gate), their product; GeLU its input and
    output; ReLU its output (which the second GEMM keeps too)."""
    return {"swiglu": 4, "relu": 1}.get(activation, 2)


def moe_saves(L, c, p: str) -> None:
    """Into ledger `L` (activation_ledger._Ledger), the tensors the MoE MLP of block `p` keeps, in the order
    they are saved; `c`: the block's sizes (activation_ledger._Dims, with its `moe` shape)."""
    m, w, h = c.moe, c.w, c.h
    R, E, k, N, M = m.tokens, m.num_experts, m.top_k, m.sent, m.received
    tok = p + ".xn2" if c.b == 1 else p + ".tok"  # (b·s, h) from (s, b, h): a view when b = 1, else a copy
    if w == 4:
        L.save(tok, R * h * 4)  # the router GEMM's input: tokens.float() is the tokens themselves
    else:
        L.save(p + ".router32", E * h * 4)
        L.save(p + ".tok32", R * h * 4)
    L.save(p + ".probs", 4 * R * E)
    L.save(p + ".chosen", 8 * R * k)  # the gather of the scores at the decided experts keeps its index
    if m.normalize and k > 1:
        L.save(p + ".topsum", 4 * R)
        L.save(p + ".top", 4 * R * k)
    if m.score == "sigmoid":
        L.save(p + ".psum", 4 * R)
    L.save(p + ".f", 4 * c.b * E)
    L.save(p + ".logits", 4 * R * E)
    L.save(p + ".z_lse", 4 * R)
    if m.ep == 1:  # every assignment has a row
        N = M = R * k
    L.save(p + ".token", 8 * N)
    grouped = grouped_gemm_fits(h, m.ffn, w)
    if m.ep == 1:
        if m.capped and (grouped or m.bias):
            L.save(p + ".valid", N)  # (N, 1) bool: the rows within the counts
        if grouped:
            L.save(p + ".rows", w * N * h)
    else:
        L.save(p + ".regroup", 8 * M)
        if grouped:
            L.save(p + ".arrived", w * M * h)
    if grouped:
        L.save(p + ".offs", 4 * m.local)
        rows = M
    else:  # padded to the largest count, balanced: the kept rows over the local experts
        padded = -(-(m.sent if m.ep == 1 else M) // m.local) * m.local
        L.save(p + ".place", 8 * M)
        L.save(p + ".padded", w * (padded + 1) * h)
        rows = padded
    if m.bias:
        L.save(p + ".expert", 8 * M)  # each row's expert, the biases gathered at it
    L.save(p + ".experts", intermediates(c.activation) * w * rows * m.ffn)
    if m.ep > 1:
        L.save(p + ".inverse", 8 * M)
    for name, n in (("slot", 8 * N), ("weight", w * N), ("y", w * N * h)):
        L.save(f"{p}.{name}", n)
    if m.shared:
        L.save(tok, w * R * h)
        L.save(p + ".shared", intermediates(c.activation) * w * R * m.shared)


__all__ = ["intermediates", "moe_saves"]
