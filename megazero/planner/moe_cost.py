"""The step-time cost of one Mixture-of-Experts MLP, one micro-batch on one rank (pure: no torch).

With the sizes of moe_plan.py (R = b·s tokens routed per rank, N rows it keeps and sends, M rows its
E / P local experts run: ρ·k·b·s on the busiest ep rank, capped by capacity; f_e = f / t_e, the
shared experts' width w_sh / t_e):

* GEMMs on `Machine.gemm`'s efficiency curve: the router (R, h)·(h, E) in fp32 (forward, input and
  weight gradient); each local expert's `mats` GEMMs over M / (E / P) rows (balanced inside the rank:
  forward, dgrad, wgrad, one kernel per expert, as megazero/moe/experts.py runs them); the shared
  experts' over R rows. The busiest rank sets the pace of the ep group, so the imbalance ρ multiplies
  the expert GEMMs (through M) and with them every rank's step.
* Memory-bound kernels at HBM bandwidth, forward (backward twice): the experts' activation (as the
  dense MLP's: 4 bytes per (M, f_e) element in 16-bit, SwiGLU 6), routing over the (R, E) fp32 scores
  (softmax, top-k, gather, losses: 16 bytes per element), gathering the N rows (read and write), with
  ep > 1 regrouping the M received rows and back (twice read and write), weighting the N outputs and
  summing them into the tokens (read y, weights, write; read, add, write: 6 bytes per element in
  16-bit), and the fp32 weight-gradient accumulation of every MoE parameter (10 bytes each).
* All-to-all over the ep group (ranks tp apart: `Machine.all_to_all`, NVLink inside a node, each
  GPU's inter-node link beyond): forward the counts (E/P·(P−1) int64s: a latency) and the dispatch
  and combine rows, N·(P−1)/P and M·(P−1)/P of h elements in the training dtype; backward the same
  two rows exchanges. None of it overlaps compute (megazero runs them in line).
* Expert tensor parallelism (t_e = tp > 1): the experts' outputs (M, h) are all-reduced over TP
  forward (g) and their input gradients backward (f), and the shared experts' (R, h) likewise; all
  exposed. With t_e = 1 every TP rank runs whole experts on the same rows and the MLP communicates
  nothing over TP (its GEMMs are not split: each TP rank does all the work).
* Full recompute reruns the forward except the counts exchange (the routing is replayed).
"""
from __future__ import annotations

from dataclasses import dataclass

from megazero.planner.machine import Machine
from megazero.planner.moe_plan import MoEShape


@dataclass(frozen=True)
class MoECost:
    """Seconds of one MoE MLP per micro-batch: `fwd`, `bwd` (input-gradient side), `wgrad` as parts dicts
    (gemm, elementwise, all_to_all, tp_comm); `recompute`: its forward's compute again under full recompute,
    `recompute_comm`: that forward's collectives (parts dict: all_to_all, tp_comm);
    `dense_params`: GEMM weights that go with the dense ones (router, shared experts) and
    `expert_params`: the routed experts' on this rank."""

    fwd: dict
    bwd: dict
    wgrad: dict
    recompute: float
    dense_params: float
    expert_params: float
    recompute_comm: dict


def _experts(mc: Machine, rows: float, count: int, width: int, h: int, mats: int) -> tuple[float, float, float]:
    """(forward, dgrad, wgrad) seconds of `count` experts of `mats` matrices of width x h, `rows` rows
    in all, one kernel per expert and matrix."""
    if count == 0 or width == 0:
        return 0.0, 0.0, 0.0
    r = rows / count
    col, row = mats - 1, 1  # gate and up (or fc1) column-parallel; down (or fc2) row-parallel
    fwd = count * (col * mc.gemm(r, width, h) + row * mc.gemm(r, h, width))
    dgrad = count * (col * mc.gemm(r, h, width) + row * mc.gemm(r, width, h))
    wgrad = count * mats * mc.gemm(width, h, r)
    return fwd, dgrad, wgrad


def moe_cost(m: MoEShape, layout, mc: Machine) -> MoECost:
    """The `MoECost` of the MoE MLP `m` (moe_plan.moe_shape) on `layout` (the module docstring's model)."""
    h, act, R, N, M, P = m.hidden, mc.act, m.tokens, m.sent, m.received, m.ep
    ex = _experts(mc, M, m.local, m.ffn, h, m.mats)
    sh = _experts(mc, R, 1 if m.shared else 0, m.shared, h, m.mats)
    router = (mc.gemm(R, m.num_experts, h), mc.gemm(R, h, m.num_experts), mc.gemm(m.num_experts, h, R))
    per_act = m.mats * act
    elem = (per_act * (M * m.ffn + R * m.shared) + 16 * R * m.num_experts + 2 * act * N * h
            + (4 * act * M * h if P > 1 else 0) + 6 * act * N * h)
    stride = layout.tp * layout.cp  # ep ranks are consecutive dp ranks: cp·tp apart
    rows = (mc.all_to_all(N * (P - 1) / P * h * act, P, stride)
            + mc.all_to_all(M * (P - 1) / P * h * act, P, stride))
    counts = mc.all_to_all(m.num_experts // P * (P - 1) * 8, P, stride)
    tp = 0.0
    if m.etp > 1:
        link = mc.link(1, m.etp)
        tp = mc.ring("all_reduce", M * h * act, m.etp, link) + mc.ring("all_reduce", R * h * act, m.etp, link) * bool(
            m.shared)
    fwd = {"gemm": router[0] + ex[0] + sh[0], "elementwise": mc.mem(elem, 6), "all_to_all": rows + counts,
           "tp_comm": tp}
    bwd = {"gemm": router[1] + ex[1] + sh[1], "elementwise": mc.mem(2 * elem, 6), "all_to_all": rows,
           "tp_comm": tp}
    dense = m.dense_params
    wgrad = {"gemm": router[2] + ex[2] + sh[2], "elementwise": mc.mem(10 * (dense + m.expert_params), 3)}
    compute = sum(v for k, v in fwd.items() if k not in ("all_to_all", "tp_comm"))
    return MoECost(fwd, bwd, wgrad, compute, dense, m.expert_params, {"all_to_all": rows, "tp_comm": tp})


__all__ = ["MoECost", "moe_cost"]
