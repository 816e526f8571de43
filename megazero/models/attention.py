"""Causal self-attention with heads split across the TP group (Megatron style).

Rank r of t holds query heads [r·a/t, (r+1)·a/t) and KV heads [r·kv/t, (r+1)·kv/t) (grouped-query
attention: query head j reads KV head j // (a/kv), so t must divide kv). q, k and v are three
column-parallel GEMMs that share ONE entry into the TP region (one f, or one sequence all-gather),
and the output projection is row-parallel: per forward one all-reduce (or all-gather +
reduce-scatter) of (s, b, h), and the same backward.

Logical parameters (layer i): ``layers.i.attn.{q,k,v}.weight`` of shape (a·d, h), (kv·d, h), (kv·d, h)
with head-major rows (head n occupies rows [n·d, (n+1)·d)), their biases, and ``layers.i.attn.out.weight``
(h, a·d) with a replicated bias. These match Hugging Face's q_proj/k_proj/v_proj/o_proj.

Positions: RoPE (rotate-half convention of GPT-NeoX/Llama) on q and k, or ALiBi (BLOOM slopes) added
to the scores. The causal softmax runs through `megazero.runtime.kernels.scaled_upper_triang_masked_softmax`.
The attention core (`SelfAttention._core`: scores, softmax, attention dropout, context) is what
selective activation checkpointing recomputes (`core_checkpoint`).
"""
from __future__ import annotations

import math

import torch
from einops import rearrange
from torch import nn

from megazero.runtime import kernels
from megazero.models.common import LayerContext
from megazero.tensor_parallel import TP_STREAM, ColumnParallelLinear, Dropout, RowParallelLinear, ShardInfo
from megazero.tensor_parallel.mappings import enter_column_region


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi slopes of BLOOM / Press et al. for `heads` heads (a geometric sequence per power of 2)."""
    def power_of_2(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]
    if math.log2(heads).is_integer():
        return power_of_2(heads)
    closest = 2 ** math.floor(math.log2(heads))
    return power_of_2(closest) + alibi_slopes(2 * closest)[0::2][: heads - closest]


def rope_cos_sin(seq: int, dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (seq, dim) for positions 0..seq-1 (halves repeated, as HF Llama)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32, device=device), inv_freq)  # (seq, dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (seq, dim)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (b, heads, seq, d) by position: x·cos + rotate_half(x)·sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class SelfAttention(nn.Module):
    """Causal multi-head / grouped-query self-attention of global layer `index` (see module docstring).

    Input (s, b, h) [(s/t, b, h) under sequence parallelism]; output the same shape, after the
    output projection, its bias and the hidden dropout (site ``layers.i.attn.dropout``). The attention
    probabilities use dropout on the TP stream (site ``layers.i.attn.probs_dropout``, sharded by head).
    """

    def __init__(self, lctx: LayerContext, index: int):
        super().__init__()
        spec, t = lctx.spec, lctx.tp_size
        self.tp_group, self.sequence_parallel = lctx.tp_group, lctx.sequence_parallel
        self.head_dim = spec.head_dim
        self.local_heads, self.local_kv = spec.heads // t, spec.num_kv_heads // t
        self.heads, self.position, self.rope_theta = spec.heads, spec.position, spec.rope_theta
        p = f"layers.{index}.attn"
        q_out, kv_out = spec.heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        col = dict(tp_group=lctx.tp_group, bias=spec.bias, sequence_parallel=lctx.sequence_parallel, comm_input=False)
        self.q = ColumnParallelLinear(spec.hidden, q_out, **col, **lctx.linear_kwargs(f"{p}.q"))
        self.k = ColumnParallelLinear(spec.hidden, kv_out, **col, **lctx.linear_kwargs(f"{p}.k"))
        self.v = ColumnParallelLinear(spec.hidden, kv_out, **col, **lctx.linear_kwargs(f"{p}.v"))
        self.out = RowParallelLinear(q_out, spec.hidden, lctx.tp_group, bias=spec.bias, input_is_parallel=True,
                                     sequence_parallel=lctx.sequence_parallel,
                                     **lctx.linear_kwargs(f"{p}.out", lctx.output_std))
        self.probs_dropout = Dropout(spec.attention_dropout, lctx.tracker, TP_STREAM, f"{p}.probs_dropout",
                                     ShardInfo(1, lctx.tp_rank, t) if t > 1 else None)
        self.dropout = lctx.hidden_dropout(f"{p}.dropout", spec.dropout)
        if spec.position == "alibi":
            slopes = alibi_slopes(spec.heads)[lctx.tp_rank * self.local_heads:(lctx.tp_rank + 1) * self.local_heads]
            self.register_buffer("alibi", torch.tensor(slopes, dtype=torch.float32,
                                                       device=lctx.device), persistent=False)
        # None, or ``fn(core, q, k, v)`` that runs the core as a recompute region (selective checkpointing:
        # `ActivationCheckpointer.attention_core`, handed in through the LayerContext)
        self.core_checkpoint = lctx.attention_core(f"{p}.core") if lctx.attention_core is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (s, b, h): one f (or sequence all-gather) for q, k, v; under sequence parallelism the
        # three GEMMs keep only the shard and gather it again in backward
        x, rg = enter_column_region(x, self.tp_group, self.sequence_parallel, 3)
        d = self.head_dim
        q = rearrange(self.q(x, rg), "s b (n d) -> b n s d", d=d)  # (b, a/t, s, d)
        k = rearrange(self.k(x, rg), "s b (n d) -> b n s d", d=d)  # (b, kv/t, s, d)
        v = rearrange(self.v(x, rg), "s b (n d) -> b n s d", d=d)
        s = q.shape[2]
        if self.position == "rope":
            cos, sin = rope_cos_sin(s, d, self.rope_theta, q.device)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.local_kv != self.local_heads:  # grouped-query: local head i reads local KV head i // group
            group = self.local_heads // self.local_kv
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if self.core_checkpoint is not None:
            attn_out = self.core_checkpoint(self._core, q, k, v)  # selective recompute: keeps q, k, v
        else:
            attn_out = self._core(q, k, v)  # (b, a/t, s, d)
        attn_out = rearrange(attn_out, "b n s d -> s b (n d)")  # (s, b, a·d/t)
        return self.dropout(self.out(attn_out))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention core: scores, causal softmax, attention dropout, context; q, k, v (b, a/t, s, d)."""
        d, s = self.head_dim, q.shape[2]
        scale = 1.0 / math.sqrt(d)
        scores = torch.matmul(q, k.transpose(-1, -2))  # (b, a/t, s, s)
        if self.position == "alibi":
            pos = torch.arange(s, device=q.device, dtype=torch.float32)
            rel = (pos.view(1, s) - pos.view(s, 1))  # (s_q, s_k): k - q, <= 0 where attended
            bias = self.alibi.view(-1, 1, 1) * rel  # (a/t, s, s)
            scores = scores * scale + bias.to(scores.dtype)
            scale = 1.0
        probs = kernels.scaled_upper_triang_masked_softmax(scores, scale)  # (b, a/t, s, s)
        probs = self.probs_dropout(probs)
        return torch.matmul(probs, v)  # (b, a/t, s, d)
