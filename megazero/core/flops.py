"""Model FLOPs of a `ModelSpec`: the one place megazero counts them (pure: no torch, no communication).

The trainer's MFU (`megazero/run/train.py`), the planner's model and hardware TFLOP/s and MFU
(`megazero/planner/speed.py:step_flops`), the ``flops`` pipeline partition's layer weights
(`megazero/core/spec_partition.py`) and the benchmarks all read these functions.

What is counted, per token, forward (2 FLOPs, a multiply and an add, per weight a token meets):

* attention projections: q and o are h x a·d each, k and v h x g·d each (a heads, g key/value heads,
  d = h / a the head dim): grouped-query attention makes k and v narrower, q and o not;
* the attention core: QKᵀ and the probabilities times V, 2·a·d FLOPs each per query and key. By default
  (``attention="full"``) every query meets all s keys of its sequence, 4·s·a·d per token: the whole
  s x s square, as Megatron-LM (Narayanan et al. 2021) and PaLM's MFU (Chowdhery et al. 2022,
  appendix B: 6·N + 12·L·H·Q·T) count it, and as the planner's published validation rows report it.
  ``attention="causal"`` counts the half of the square a causal mask keeps, 2·s·a·d per token, as
  FlashAttention's benchmarks do (the diagonal's extra half key per query left out);
* the MLP: 2·h·ffn per weight matrix, 3 matrices for SwiGLU (gate, up, down), 2 otherwise (GeLU, ReLU).
  A Mixture-of-Experts MLP counts what a token runs, not what the layer holds: the router (h x E), its
  top_k routed experts and the shared experts (`megazero.core.moe_spec.MoESpec.active_mlp_params`);
* the head: the logits GEMM, 2·h·V, whether or not its weight is tied to the input embedding;
  the input embedding is a lookup (no GEMM), 0 FLOPs, so tying changes nothing here;
* not counted: biases, norms, activations, softmax, residual adds, RoPE, the loss (Megatron leaves
  them out too: they are not GEMMs).

A training step: backward is twice the forward (the input gradient and the weight gradient, each a
GEMM of the forward's size), so model FLOPs are 3 x forward x tokens (tokens = global batch x seq_len).
Hardware FLOPs add what activation recompute runs again (`hardware_flops_per_step`): full recompute each
block's forward (not the head's), selective recompute the attention core. MFU divides model FLOPs by
time x devices x peak; hardware FLOPs are what Megatron-LM's and Megatron-DeepSpeed's TFLOP/s report.

For GPT (a = h / d heads of all keys, ffn = 4h, GeLU) these give Megatron's closed forms:
72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) model FLOPs per step and, with full recompute,
96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) hardware FLOPs (tests/test_flops.py).
"""
from __future__ import annotations

from dataclasses import dataclass

ATTENTION = ("full", "causal")
"""How the attention core's s x s square is counted: all of it (Megatron, PaLM) or the causal half."""
RECOMPUTE = ("none", "selective", "full")
"""Activation recompute policies (``activation_checkpointing.policy``): what hardware FLOPs add."""
KINDS = ("embedding", "block", "head")
"""The pipeline layers of a spec model (`megazero.core.spec_partition.layer_kinds`)."""
FORWARD_BACKWARD = 3
"""A training step's FLOPs per forward FLOP: the forward, and backward's input and weight gradients."""


@dataclass(frozen=True)
class BlockFlops:
    """Forward FLOPs per token of one transformer block, by part: `qkv` (q, k and v projections), `out`
    (the attention's output projection), `core` (QKᵀ and PV), `mlp` (dense, or an MoE MLP's router,
    routed and shared experts)."""

    qkv: float
    out: float
    core: float
    mlp: float

    @property
    def weight_gemms(self) -> float:
        """The GEMMs with a weight (all but the attention core): 2 x the weights a token meets."""
        return self.qkv + self.out + self.mlp

    @property
    def total(self) -> float:
        return self.weight_gemms + self.core


def weight_flops(params: float) -> float:
    """Forward FLOPs per token of a GEMM layer holding `params` weights: 2 each (a multiply and an add)."""
    return 2.0 * params


def _check(attention: str) -> None:
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} must be one of {', '.join(ATTENTION)}")


def block_forward(spec, attention: str = "full") -> BlockFlops:
    """`BlockFlops` of one block of `spec` (a ModelSpec), whole (not a TP rank's part)."""
    _check(attention)
    h, d, a, g = spec.hidden, spec.head_dim, spec.heads, spec.num_kv_heads
    keys = spec.seq_len if attention == "full" else spec.seq_len / 2  # keys one query meets, on average
    if spec.moe is None:
        mlp = weight_flops((3 if spec.activation == "swiglu" else 2) * h * spec.ffn)
    else:
        mlp = weight_flops(spec.moe.active_mlp_params(h))
    return BlockFlops(qkv=weight_flops(h * (a + 2 * g) * d), out=weight_flops(a * d * h),
                      core=2 * 2.0 * keys * a * d, mlp=mlp)


def head_forward(spec) -> float:
    """Forward FLOPs per token of the head: the logits GEMM over the (unpadded) vocabulary, tied or not."""
    return weight_flops(spec.hidden * spec.vocab)


def layer_forward(spec, kind: str, attention: str = "full") -> float:
    """Forward FLOPs per token of one pipeline layer of `kind` (`KINDS`): the embedding 0 (a lookup)."""
    if kind == "block":
        return block_forward(spec, attention).total
    if kind == "head":
        return head_forward(spec)
    if kind == "embedding":
        return 0.0
    raise ValueError(f"kind={kind!r} must be one of {', '.join(KINDS)}")


def layer_flops_per_token(spec, kind: str, attention: str = "full") -> float:
    """Forward + backward FLOPs per token of one pipeline layer of `kind`: what the ``flops`` partition
    balances."""
    return FORWARD_BACKWARD * layer_forward(spec, kind, attention)


def forward_per_token(spec, attention: str = "full") -> float:
    """Forward FLOPs per token of the whole model: L blocks and the head."""
    return spec.layers * block_forward(spec, attention).total + head_forward(spec)


def model_flops_per_token(spec, attention: str = "full") -> float:
    """Model FLOPs per token of a training step: forward + backward = 3 x forward."""
    return FORWARD_BACKWARD * forward_per_token(spec, attention)


def model_flops_per_step(spec, global_batch: int, attention: str = "full") -> float:
    """Model FLOPs of one optimizer step over `global_batch` sequences of `spec.seq_len` tokens: what MFU
    divides by time x devices x peak."""
    return global_batch * spec.seq_len * model_flops_per_token(spec, attention)


def recompute_per_token(spec, recompute: str, attention: str = "full") -> float:
    """FLOPs per token that activation recompute runs again in backward (`RECOMPUTE`): full, each block's
    forward; selective, each block's attention core; none, 0."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} must be one of {', '.join(RECOMPUTE)}")
    block = block_forward(spec, attention)
    return spec.layers * {"full": block.total, "selective": block.core, "none": 0.0}[recompute]


def hardware_flops_per_step(spec, global_batch: int, recompute: str = "none", attention: str = "full") -> float:
    """Model FLOPs of a step plus the recompute's forward FLOPs: what the hardware runs."""
    tokens = global_batch * spec.seq_len
    return model_flops_per_step(spec, global_batch, attention) + tokens * recompute_per_token(spec, recompute,
                                                                                               attention)


__all__ = ["ATTENTION", "FORWARD_BACKWARD", "KINDS", "RECOMPUTE", "BlockFlops", "block_forward",
           "forward_per_token", "hardware_flops_per_step", "head_forward", "layer_flops_per_token",
           "layer_forward", "model_flops_per_step", "model_flops_per_token", "recompute_per_token", "weight_flops"]
