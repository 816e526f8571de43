"""Causal self-attention with heads split across the TP group (Megatron style).

Rank r of t holds query heads [r·a/t, (r+1)·a/t) and KV heads [r·kv/t, (r+1)·kv/t) (grouped-query
attention: query head j reads KV head j // (a/kv), so t must divide kv). q, k and v are three
column-parallel GEMMs that share ONE entry into the TP region (one f, or one sequence all-gather),
and the output projection is row-parallel: per forward one all-reduce (or all-gather +
reduce-scatter) of (s, b, h), and the same backward.

Logical parameters (layer i): ``layers.i.attn.{q,k,v}.weight`` of shape (a·d, h), (kv·d, h), (kv·d, h)
with head-major rows (head n occupies rows [n·d, (n+1)·d)), their biases, and ``layers.i.attn.out.weight``
(h, a·d) with a replicated bias. These match Hugging Face's q_proj/k_proj/v_proj/o_proj.

Positions: RoPE (rotate-half convention of GPT-NeoX/Llama) on q and k, with cos/sin tables built once
per model (`RopeTables`, shared by every layer through the LayerContext), or ALiBi (BLOOM slopes) added
to the scores.

The attention core (scores, causal softmax, attention dropout, context) has two implementations:

* `SelfAttention.sdpa_core`: `torch.nn.functional.scaled_dot_product_attention` (flash or
  memory-efficient kernels on CUDA, a fused flash kernel on CPU) with native grouped-query attention
  (K/V are never repeated) and ALiBi as an additive float mask (`AlibiBias`: one per model, 4-D so that
  a fused kernel takes it). It never materialises the
  (b, a/t, s, s) scores on the flash path. It runs whenever attention dropout is inactive (p = 0, or eval).
* `SelfAttention.reference_core`: the explicit twin (GEMM, `kernels.scaled_upper_triang_masked_softmax`,
  dropout, GEMM), K/V repeated per query head. It runs when attention dropout is active in training,
  because SDPA's dropout draws from the global generator: megazero's dropout masks are drawn per site
  and sharded by head so that every TP layout drops the same elements as one process.

Both take q (b, a/t, s, d), k and v (b, kv/t, s, d) and agree within 1e-6 in fp32
(tests/test_attention_core.py). The core is what selective activation checkpointing recomputes
(`core_checkpoint`).

Context parallelism (`lctx.cp_group` of cp > 1 ranks): the layer holds s/cp tokens, a head and a tail chunk
of the sequence (`megazero.context_parallel.token_layout`); RoPE rotates them by their own positions and
the core is `context_core`: ring attention or Ulysses over the cp group (`megazero.context_parallel`).

Packed documents (`lctx.packed`, `megazero.models.packed`): every core attends within documents (SDPA and the
reference core by a boolean mask, the context-parallel cores by the document ids) and RoPE rotates each token
by its position within its document. The ids are read through `PackedDocuments.current`, so that a recompute
uses its own micro-batch's.
"""
from __future__ import annotations

import math

import torch
from einops import rearrange
from torch import nn

from megazero.context_parallel import ring_attention, token_layout, ulysses_attention
from megazero.runtime import kernels
from megazero.models.common import LayerContext
from megazero.models.packed import document_mask, positions_in_documents
from megazero.models.rope import RopeTables, apply_rope
from megazero.tensor_parallel import (TP_STREAM, ColumnParallelLinear, Dropout, RowParallelLinear, ShardInfo,
                                      column_parallel_region)


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi slopes of BLOOM / Press et al. for `heads` heads (a geometric sequence per power of 2)."""
    def power_of_2(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]
    if math.log2(heads).is_integer():
        return power_of_2(heads)
    closest = 2 ** math.floor(math.log2(heads))
    return power_of_2(closest) + alibi_slopes(2 * closest)[0::2][: heads - closest]


def alibi_bias(slopes: torch.Tensor, seq: int, dtype: torch.dtype) -> torch.Tensor:
    """ALiBi's additive bias (heads, seq, seq): slope·(k − q) where k <= q (attended), −inf above the
    diagonal (the causal mask), for the fused core's float mask."""
    pos = torch.arange(seq, device=slopes.device, dtype=torch.float32)
    rel = pos.view(1, seq) - pos.view(seq, 1)  # (s_q, s_k): k - q
    bias = slopes.view(-1, 1, 1).float() * rel  # (heads, s, s)
    return bias.masked_fill(rel > 0, float("-inf")).to(dtype)


class AlibiBias:
    """One model's ALiBi float mask for the fused core, (1, a/t, s, s) in the compute dtype: built once
    per sequence length, device and dtype, and shared by every layer (the LayerContext holds it), instead
    of an fp32 (heads, s, s) rebuilt by every layer for every micro-batch. Four dimensions, because
    SDPA's fused kernels (flash on CPU, memory-efficient on CUDA) take a float mask only as 2-D or 4-D:
    a 3-D one sends every call to the math backend, which materialises the scores. Local."""

    def __init__(self, slopes: list[float]):
        self.slopes = slopes  # this TP rank's heads
        self._masks: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}
        self.builds = 0

    def get(self, seq: int, device, dtype: torch.dtype) -> torch.Tensor:
        key = (seq, torch.device(device), dtype)
        mask = self._masks.get(key)
        if mask is None:
            with torch.inference_mode(False):
                slopes = torch.tensor(self.slopes, dtype=torch.float32, device=device)
                mask = self._masks[key] = alibi_bias(slopes, seq, dtype).unsqueeze(0)  # (1, a/t, s, s)
            self.builds += 1
        return mask


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
        self.heads, self.position = spec.heads, spec.position
        self.rope = None  # position='rope': the model's shared tables (its own when built alone)
        if spec.position == "rope":
            self.rope = lctx.rope_tables or RopeTables(spec.head_dim, spec.rope_theta)
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
            self.alibi_mask = lctx.alibi_bias or AlibiBias(slopes)  # the model's, shared by its layers
        self.cp_group, self.cp_method = lctx.cp_group, lctx.cp_method  # context parallel, or None
        self.packed, self.decisions, self.site = lctx.packed, lctx.decisions, p  # packed documents, or None
        # None, or ``fn(core, q, k, v)`` that runs the core as a recompute region (selective checkpointing:
        # `ActivationCheckpointer.attention_core`, handed in through the LayerContext)
        self.core_checkpoint = lctx.attention_core(f"{p}.core") if lctx.attention_core is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (s, b, h): one column-parallel region for q, k, v: one f (or sequence all-gather) forward,
        # one all-reduce (reduce-scatter) backward, in flight while their weight-gradient GEMMs run
        q, k, v = column_parallel_region(x, (self.q, self.k, self.v))  # (s, b, ·/t) each
        d = self.head_dim
        q = rearrange(q, "s b (n d) -> b n s d", d=d)  # (b, a/t, s, d)
        k = rearrange(k, "s b (n d) -> b n s d", d=d)  # (b, kv/t, s, d)
        v = rearrange(v, "s b (n d) -> b n s d", d=d)
        if self.rope is not None:
            cos, sin = self._rope_tables(q)  # (s[/cp], d)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        dropout_active = self.training and self.probs_dropout.p > 0
        core = self.reference_core if dropout_active else self.sdpa_core
        if self.cp_group is not None:
            core = self.context_core
        if self.core_checkpoint is not None:
            attn_out = self.core_checkpoint(core, q, k, v)  # selective recompute: keeps q, k, v
        else:
            attn_out = core(q, k, v)  # (b, a/t, s, d)
        attn_out = rearrange(attn_out, "b n s d -> s b (n d)")  # (s, b, a·d/t)
        return self.dropout(self.out(attn_out))

    def _docs(self, what: str) -> torch.Tensor | None:
        """Packed documents: the micro-batch's document ids (b, s) (the forward's again in a recompute); None."""
        return None if self.packed is None else self.packed.current(self.decisions, f"{self.site}.{what}")

    def _rope_tables(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for q's n tokens: (n, d) for positions 0..n-1 or, with context parallelism, this rank's;
        (b, 1, n, d) for positions within packed documents."""
        cp = 1 if self.cp_group is None else self.cp_group.size
        seq = q.shape[2] * cp
        cos, sin = self.rope.get(seq, q.device, q.dtype)  # (s, d)
        docs = self._docs("rope")
        if docs is not None:
            pos = positions_in_documents(docs)  # (b, s)
            if cp > 1:
                pos = token_layout.take(pos, 1, self.cp_group.rank, cp)  # (b, s/cp)
            return cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)  # (b, 1, n, d)
        if cp == 1:
            return cos, sin
        mine = token_layout.positions(seq, self.cp_group.rank, cp, q.device)  # (s/cp,)
        return cos[mine], sin[mine]

    def context_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The core over the whole sequence when this rank holds s/cp tokens of it: q (b, a/t, s/cp, d), k and v
        (b, kv/t, s/cp, d) -> (b, a/t, s/cp, d). Communicates over the cp group: point to point around it (ring)
        or all-to-all (ulysses); see `megazero.context_parallel`."""
        fn = ring_attention if self.cp_method == "ring" else ulysses_attention
        slopes = self.alibi if self.position == "alibi" else None
        return fn(q, k, v, self.cp_group, q.shape[2] * self.cp_group.size, docs=self._docs("core"), slopes=slopes)

    def sdpa_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The fused core (no attention dropout): q (b, a/t, s, d), k and v (b, kv/t, s, d) -> (b, a/t, s, d).
        Query head i reads KV head i // (a/kv) (SDPA's enable_gqa: the same grouping as repeat_interleave)."""
        gqa = self.local_kv != self.local_heads
        docs = self._docs("core")
        if self.position == "alibi":
            bias = self.alibi_mask.get(q.shape[2], q.device, q.dtype)  # (1, a/t, s, s), -inf above the diagonal
            if docs is not None:  # and between documents
                bias = bias.masked_fill(~document_mask(docs), float("-inf"))  # (b, a/t, s, s)
            if gqa and q.is_cuda:  # CUDA's kernel for float masks (memory-efficient) has no grouped-query mode
                group = self.local_heads // self.local_kv
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (b, a/t, s, d)
                gqa = False
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=gqa)
        if docs is not None:  # block-diagonal causal: (b, 1, s, s) boolean
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(docs),
                                                                    enable_gqa=gqa)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def reference_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The explicit core: scores, causal softmax, attention dropout, context; q (b, a/t, s, d), k and v
        (b, kv/t, s, d), repeated here to one KV head per query head."""
        if self.local_kv != self.local_heads:  # grouped-query: local head i reads local KV head i // group
            group = self.local_heads // self.local_kv
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (b, a/t, s, d)
        d, s = self.head_dim, q.shape[2]
        scale = 1.0 / math.sqrt(d)
        scores = torch.matmul(q, k.transpose(-1, -2))  # (b, a/t, s, s)
        if self.position == "alibi":
            pos = torch.arange(s, device=q.device, dtype=torch.float32)
            rel = (pos.view(1, s) - pos.view(s, 1))  # (s_q, s_k): k - q, <= 0 where attended
            bias = self.alibi.view(-1, 1, 1) * rel  # (a/t, s, s)
            scores = scores * scale + bias.to(scores.dtype)
            scale = 1.0
        docs = self._docs("core")
        if docs is not None:  # packed documents: nothing across a document boundary (the kernel masks above the diagonal)
            scores = scores.masked_fill(~document_mask(docs), float("-inf"))
        probs = kernels.scaled_upper_triang_masked_softmax(scores, scale)  # (b, a/t, s, s)
        probs = self.probs_dropout(probs)
        return torch.matmul(probs, v)  # (b, a/t, s, d)
