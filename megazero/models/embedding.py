"""The first and last layers of the language model: token embedding and final norm + LM head.

`EmbeddingLayer`: tokens (b, s) -> hidden (s, b, h) [(s/t, b, h) under sequence parallelism]. With context
parallelism it takes the whole sequence's tokens and keeps this cp rank's s/cp of them
(`megazero.context_parallel.token_layout`): hidden (s/cp, b, h) [(s/(cp·t), b, h)].
Vocabulary-parallel word embedding (one all-reduce over the TP group forward, or a reduce-scatter
along the sequence under sequence parallelism), plus learned positions (``position='learned'``),
then, with ``spec.embedding_norm``, a norm (``embedding.norm``; BLOOM's word_embeddings_layernorm, on
the sequence shard under sequence parallelism, like the blocks' norms), then hidden dropout (site
``embedding.dropout``).

`HeadLayer`: hidden -> vocabulary-parallel logits (s, b, Vp/t) of the padded vocabulary Vp. Final
norm, then one entry into the TP region (f, or the sequence all-gather), then the local GEMM with
this rank's rows of the output embedding. With tied embeddings the head's weight is the logical
parameter ``embedding.word.weight`` (``tied_name = "embedding.word"``): `CausalLM` (pp=1) shares the
embedding's parameter object; a pipeline's last stage builds its own copy, which layout-invariant init
makes equal to the first stage's, and sums the two gradients over the embedding group.
"""
from __future__ import annotations

import torch
from torch import nn

from megazero.context_parallel import token_layout
from megazero.models.common import LayerContext, Norm
from megazero.models.packed import positions_in_documents
from megazero.tensor_parallel import VocabParallelEmbedding, make_param
from megazero.tensor_parallel.mappings import enter_tp_region
from megazero.tensor_parallel.weight_grad import linear

TIED_EMBEDDING = "embedding.word"


class EmbeddingLayer(nn.Module):
    """Token (+ learned position) embedding; see the module docstring."""

    def __init__(self, lctx: LayerContext):
        super().__init__()
        spec = lctx.spec
        self.tp_group, self.sequence_parallel = lctx.tp_group, lctx.sequence_parallel
        self.cp_group = lctx.cp_group  # None: the whole sequence here
        self.packed, self.decisions = lctx.packed, lctx.decisions  # packed documents: positions restart per document
        self.word = VocabParallelEmbedding(spec.vocab, spec.hidden, lctx.tp_group, vocab_align=spec.vocab_align,
                                           sequence_parallel=lctx.sequence_parallel, name=TIED_EMBEDDING,
                                           seed=lctx.seed, init_std=spec.init_std, device=lctx.device,
                                           dtype=lctx.dtype)
        if spec.tie_embeddings:
            self.word.weight.tied_name = TIED_EMBEDDING
        self.position = None
        if spec.position == "learned":
            self.position = lctx.replicated_param((spec.seq_len, spec.hidden), "embedding.position.weight", "normal")
        self.norm = Norm(lctx, "embedding.norm") if spec.embedding_norm else None
        self.dropout = lctx.hidden_dropout("embedding.dropout", spec.dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        mine = None  # context parallel: this rank's positions
        if self.cp_group is not None:
            mine = token_layout.positions(s, self.cp_group.rank, self.cp_group.size, tokens.device)  # (s/cp,)
            tokens = token_layout.take(tokens, 1, self.cp_group.rank, self.cp_group.size)  # (b, s/cp)
        h = self.word(tokens.t())  # (s, b, h), or (s/t, b, h) under sequence parallelism [s/cp with cp]
        if self.position is not None:
            if s > self.position.shape[0]:
                raise ValueError(f"sequence length {s} exceeds the spec's seq_len={self.position.shape[0]} "
                                 f"(learned positions)")
            if self.packed is not None:  # each token's position within its document
                within = positions_in_documents(self.packed.current(self.decisions, "embedding.docs"))  # (b, s)
                if mine is not None:
                    within = token_layout.take(within, 1, self.cp_group.rank, self.cp_group.size)  # (b, s/cp)
                pos = self.position[within].transpose(0, 1)  # (s[/cp], b, h)
            else:
                pos = (self.position[:s] if mine is None else self.position[mine]).unsqueeze(1)  # (s[/cp], 1, h)
            if self.sequence_parallel and self.tp_group.size > 1:
                pos = pos.chunk(self.tp_group.size, dim=0)[self.tp_group.rank]  # (s/t, ·, h)
            h = h + pos
        if self.norm is not None:
            h = self.norm(h)  # (s, b, h) or (s/t, b, h): replicated params, sequence_parallel-marked
        return self.dropout(h)


class HeadLayer(nn.Module):
    """Final norm + vocabulary-parallel LM head; see the module docstring."""

    def __init__(self, lctx: LayerContext):
        super().__init__()
        spec = lctx.spec
        t = lctx.tp_size
        self.tp_group, self.sequence_parallel = lctx.tp_group, lctx.sequence_parallel
        self.vocab, self.padded_vocab = spec.vocab, spec.padded_vocab(t)
        self.norm = Norm(lctx, "head.norm")
        name = f"{TIED_EMBEDDING}.weight" if spec.tie_embeddings else "head.weight"
        self.weight = make_param((self.padded_vocab // t, spec.hidden), logical_name=name,
                                 full_shape=(spec.vocab, spec.hidden), tp_dim=0, tp_rank=lctx.tp_rank, tp_size=t,
                                 init="normal", seed=lctx.seed, std=spec.init_std, device=lctx.device, dtype=lctx.dtype)
        if spec.tie_embeddings:
            self.weight.tied_name = TIED_EMBEDDING

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = enter_tp_region(self.norm(hidden), self.tp_group, self.sequence_parallel)  # (s, b, h)
        return linear(x, self.weight)  # (s, b, Vp/t); see weight_grad.linear (ZeRO-3)
