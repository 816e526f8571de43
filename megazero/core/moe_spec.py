"""A Mixture-of-Experts MLP's architecture (pure data, no torch): `MoESpec` and its checks.

Routing is per token over `num_experts` experts: scores are the softmax (or sigmoid) of the router's
logits, each token goes to its `top_k` best experts, weighted by their scores (renormalised over the
k when `normalize_topk` and k > 1; with k = 1 the score itself, so that the router learns from the
loss). With `capacity_factor` set, each expert takes at most
``ceil(capacity_factor · seq_len · top_k / num_experts)`` assignments *per sequence* (first choices
before second choices, earlier positions first) and drops the rest; None drops nothing. Counting
capacity per sequence (GShard's groups, one group a sequence) makes the same tokens drop in every
layout, whatever the micro-batch or the data-parallel split.

Losses, also per sequence and then averaged over sequences (so layout-invariant too):
load balancing ``aux_loss_coef · E · Σ_e f_e · P_e`` (Switch / GShard: f_e the fraction of the
sequence's k·s assignments that chose expert e, before dropping; P_e its mean routing probability)
and router z-loss ``z_loss_coef · mean(logsumexp(logits)²)`` (ST-MoE).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

SCORES = ("softmax", "sigmoid")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "swiglu")


class MoESpecError(ValueError):
    """An MoE setting that cannot work; the message names the key and what would be valid."""


@dataclass(frozen=True)
class MoESpec:
    """One MoE MLP. `ffn`: each routed expert's hidden size; `shared_experts` dense experts of
    `shared_ffn` each (DeepSeek) run on every token and add to the routed output."""

    num_experts: int
    ffn: int
    top_k: int = 2
    activation: str = "swiglu"
    score: str = "softmax"
    normalize_topk: bool = True
    capacity_factor: float | None = None
    aux_loss_coef: float = 1e-2
    z_loss_coef: float = 1e-3
    shared_experts: int = 0
    shared_ffn: int | None = None

    def check(self, ep: int = 1) -> None:
        """MoESpecError for a setting that cannot run with `ep` expert-parallel ranks."""
        if self.num_experts < 1:
            raise MoESpecError(f"model.moe.num_experts={self.num_experts} must be >= 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise MoESpecError(f"model.moe.top_k={self.top_k} must be between 1 and num_experts={self.num_experts}")
        if self.score not in SCORES:
            raise MoESpecError(f"model.moe.score={self.score!r} must be one of {', '.join(SCORES)}")
        if self.activation not in ACTIVATIONS:
            raise MoESpecError(f"model.moe.activation={self.activation!r} must be one of {', '.join(ACTIVATIONS)}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise MoESpecError(f"model.moe.capacity_factor={self.capacity_factor} must be > 0, or null for no "
                               f"token dropping")
        if self.ffn < 1 or self.shared_experts < 0 or (self.shared_experts and (self.shared_ffn or self.ffn) < 1):
            raise MoESpecError("model.moe.ffn and shared_ffn must be >= 1 and shared_experts >= 0")
        if ep < 1 or self.num_experts % ep:
            raise MoESpecError(f"model.moe.num_experts={self.num_experts} does not split over parallel.ep={ep} "
                               f"ranks; use an ep that divides it")

    @property
    def matrices(self) -> int:
        """Weight matrices per expert: 3 for SwiGLU (gate, up, down), else 2."""
        return 3 if self.activation == "swiglu" else 2

    def active_mlp_params(self, hidden: int) -> int:
        """Weights one token runs through in the MoE MLP (biases aside): the router (E·h), its top_k
        routed experts and the shared experts, whole (not a TP rank's part)."""
        shared = (self.shared_ffn or self.ffn) * self.shared_experts
        return hidden * (self.num_experts + self.matrices * (self.top_k * self.ffn + shared))

    def capacity(self, seq_len: int) -> int | None:
        """Assignments one expert takes per sequence (None: no dropping)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(round(self.capacity_factor * seq_len * self.top_k / self.num_experts, 9))


def grouped_gemm_fits(hidden: int, ffn: int, itemsize: int) -> bool:
    """Whether an expert's GEMMs of `hidden` x `ffn` (its ffn on this TP rank) with elements of `itemsize`
    bytes have the 16-byte aligned row strides `torch._grouped_mm` needs (the rows (N, h) and (N, f),
    the weights and the gradients): `megazero.moe.experts.GroupedExperts` runs its experts as grouped
    GEMMs then, else padded to the largest count (the planner's ledger follows the same choice)."""
    return (hidden * itemsize) % 16 == 0 and (ffn * itemsize) % 16 == 0


__all__ = ["MoESpec", "MoESpecError", "grouped_gemm_fits"]
