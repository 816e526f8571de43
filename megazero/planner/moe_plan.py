"""A Mixture-of-Experts layer as the planner sees it on one rank of a layout (pure: no torch).

`moe_shape(spec, layout)` gives the sizes that memory_plan.py, activation_ledger.py and the step-time
model read, so the routing assumption is stated once, here. Notation: E experts, k top-k, P = ep
expert-parallel ranks, f each routed expert's ffn, t_e = `Layout.etp` (the TP split of an expert's
ffn: 1 or tp), b micro-batch, s sequence, ρ = `Layout.moe_imbalance`, C the capacity per expert and
sequence (`MoESpec.capacity`; none: unlimited).

* Parameters on one rank, per MoE layer (megazero/moe/experts.py): the router (E, h), TP-replicated,
  with the dense parameters; E / P routed experts of `mats` matrices of f / t_e · h each (SwiGLU gate,
  up, down: 3; GeLU / ReLU fc1, fc2: 2) and, for a spec with biases, their column biases (f / t_e)
  and replicated output bias (h), in their own flat group (`megazero.zero.grouping.make_groups`);
  the shared experts (DeepSeek), one MLP of width shared_experts · shared_ffn, split over t_e like the
  routed ones, with the dense parameters.
* Rows per micro-batch. Each rank routes its own R = b·s tokens. The assumption: routing is balanced,
  every expert takes k·s / E assignments of each sequence, except that capacity keeps at most C of
  them. So a rank keeps (and sends) N = b·min(k·s, E·C) assignments; with P = 1 its experts run
  exactly those (M = N, whatever the imbalance between them; their buffers hold all k·b·s rows,
  the dropped ones after the counts: moe_ledger.py); with P > 1 the busiest ep rank receives
  M = b·min(ρ·k·s, E·C) rows (ρ = 1: M = N; the cap: its E / P experts take at most C rows of each
  of the P·b sequences). Balanced routing sends N / P rows to each ep rank, its own included.
* All-to-all, elements one rank sends to the others per micro-batch: forward, dispatch N·(P−1)/P·h
  and combine M·(P−1)/P·h rows (training dtype), plus (P−1)·E/P int64 counts; backward moves the
  rows' gradients back the same way (no counts): 2·(N + M)·(P−1)/P·h rows' elements and the counts
  in all, the four all-to-alls of (P−1)/P·k·b·s·h each when balanced without drops. A full
  recompute reruns the forward's two row all-to-alls (it replays the forward's routing and counts).
* Model FLOPs count the active parameters: per token the router 2·h·E, k routed experts and the
  shared experts, 2·h·mats·(k·f + shared width) (`megazero.core.flops.block_forward`, the trainer's too).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MoEShape:
    """One MoE layer on one rank, per micro-batch (module docstring): `local` = E / P experts; `ffn` and
    `shared` the routed expert's and the shared experts' widths on this TP rank (/ t_e); `tokens` R;
    `sent` N; `received` M; `capped`: a capacity is set (assignments may drop)."""

    num_experts: int
    local: int
    top_k: int
    ffn: int
    shared: int
    mats: int
    hidden: int
    tokens: int
    sent: int
    received: int
    ep: int
    etp: int
    score: str
    normalize: bool
    bias: bool = False
    capped: bool = False

    @property
    def expert_params(self) -> int:
        """Routed-expert parameters of this rank: E / P experts of mats · f / t_e · h (with the MLP
        biases also (mats − 1) · f / t_e column biases and the replicated output bias, h)."""
        bias = (self.mats - 1) * self.ffn + self.hidden if self.bias else 0
        return self.local * (self.mats * self.ffn * self.hidden + bias)

    @property
    def dense_params(self) -> int:
        """The MoE MLP's parameters that go with the dense ones: the router E·h and the shared experts
        (with biases: (mats − 1)·width + h)."""
        bias = (self.mats - 1) * self.shared + self.hidden if self.bias and self.shared else 0
        return self.num_experts * self.hidden + self.mats * self.shared * self.hidden + bias

    def all_to_all_elements(self) -> tuple[int, int, int]:
        """(row elements of the forward's two all-to-alls, of the backward's two, int64 counts of the
        forward's exchange) one rank sends to the others per micro-batch (module docstring)."""
        p = self.ep
        if p == 1:
            return 0, 0, 0
        rows = (self.sent + self.received) * (p - 1) // p * self.hidden
        return rows, rows, (p - 1) * self.num_experts // p


def all_to_all_per_step(shape: MoEShape, layout, blocks: int) -> tuple[int, int]:
    """(elements, bytes) one rank of a stage with `blocks` MoE blocks sends in all-to-alls in one step
    (what `megazero.runtime.comm` counts): per micro-batch and block the forward's rows (training
    dtype) and counts (int64), the backward's rows, and under full recompute the forward's rows again."""
    w = {"bf16": 2, "fp16": 2, "fp32": 4}[layout.precision]
    fwd, bwd, counts = shape.all_to_all_elements()
    rows = fwd * (2 if layout.recompute == "full" else 1) + bwd
    n = layout.num_microbatches * blocks
    return n * (rows + counts), n * (rows * w + counts * 8)


def moe_shape(spec, layout) -> MoEShape | None:
    """The `MoEShape` of `spec`'s MoE layers on `layout` (None for a dense model)."""
    moe = getattr(spec, "moe", None)
    if moe is None:
        return None
    # with context parallelism each rank routes its s/cp tokens of every sequence (no capacity then: refused)
    E, k, s, b, P = moe.num_experts, moe.top_k, spec.seq_len // layout.cp, layout.micro_batch, layout.ep
    cap = moe.capacity(s)
    cap_rows = math.inf if cap is None else E * cap
    sent = b * min(k * s, cap_rows)
    received = sent if P == 1 else math.ceil(round(b * min(layout.moe_imbalance * k * s, cap_rows), 9))
    etp = layout.etp
    return MoEShape(num_experts=E, local=E // P, top_k=k, ffn=moe.ffn // etp,
                    shared=(moe.shared_ffn or moe.ffn) * moe.shared_experts // etp, mats=moe.matrices,
                    hidden=spec.hidden, tokens=b * s, sent=int(sent), received=int(received), ep=P, etp=etp,
                    score=moe.score, normalize=moe.normalize_topk, bias=spec.bias, capped=cap is not None)


def active_params(spec, total: int) -> int:
    """Parameters a token runs through, of a model of `total` (all of them for a dense model): an MoE
    model's total less the routed experts a token does not use, E − k of every layer's (with their
    biases when the spec has them)."""
    moe = spec.moe
    if moe is None:
        return total
    mats = moe.matrices
    per_expert = mats * moe.ffn * spec.hidden + ((mats - 1) * moe.ffn + spec.hidden if spec.bias else 0)
    return total - spec.layers * (moe.num_experts - moe.top_k) * per_expert


__all__ = ["MoEShape", "active_params", "all_to_all_per_step", "moe_shape"]
