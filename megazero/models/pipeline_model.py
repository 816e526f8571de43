"""A model spec as a PipelineModule: each pipeline rank builds only its own layers.

`build_pipeline_model(spec, ctx, ...)` turns `layer_builders` (embedding, blocks, head) into layer
specs for `PipelineModule`, partitions them over `ctx.pp_size * chunks` virtual stages, and ties the
LM head to the word embedding: by sharing the parameter when both live on this rank (pp=1), else
through `tied_name` (the ZeRO optimizer sums the two copies' gradients over the embedding group).
The loss is the vocabulary-parallel cross-entropy over the TP group; activations between stages
are (s, b, h), or (s/t, b, h) under sequence parallelism.
"""
from __future__ import annotations

import torch

from megazero.models.embedding import EmbeddingLayer, HeadLayer
from megazero.models.lm import causal_lm_loss, layer_builders
from megazero.pipeline.pipeline_module import LayerSpec, PipelineModule
from megazero.core.spec import ModelSpec
from megazero.tensor_parallel import RNGStatesTracker


def build_pipeline_model(spec: ModelSpec, ctx, *, seed: int = 0, sequence_parallel: bool = False,
                         dtype: torch.dtype = torch.float32, partition="uniform", chunks: int = 1,
                         label_smoothing: float = 0.0, device=None, wrap_block=None,
                         activation_checkpointer=None) -> PipelineModule:
    """This rank's PipelineModule for `spec` on the groups of `ctx` (tp_group for the layers, the
    pipeline coordinates for the partition). `wrap_block(module) -> module` may wrap each
    transformer block. `activation_checkpointer` (a `megazero.activation_checkpoint.ActivationCheckpointer`,
    exclusive with wrap_block) wraps the blocks, groups them into segments per chunk, and is kept as
    ``model.activation_checkpointer``."""
    if activation_checkpointer is not None:
        if wrap_block is not None:
            raise ValueError("build_pipeline_model: pass wrap_block or activation_checkpointer, not both")
        wrap_block = activation_checkpointer.wrap_block
    tracker = RNGStatesTracker(seed, ctx.tp_rank, ctx.pp_rank)
    builders = layer_builders(spec, ctx.tp_group, seed=seed, sequence_parallel=sequence_parallel,
                              tracker=tracker, dtype=dtype, pp_rank=ctx.pp_rank)
    layers = []
    for b in builders:
        ls = LayerSpec(_wrap, b, device, wrap_block if b.kind == "block" else None)
        ls.layer_type = {"embedding": "EmbeddingLayer", "block": "TransformerBlock", "head": "HeadLayer"}[b.kind]
        ls.flops_per_token = _flops_per_token(spec, b.kind)
        ls.num_params = b.num_params
        layers.append(ls)
    tp_group = ctx.tp_group

    def loss_fn(logits, labels):
        return causal_lm_loss(logits, labels, tp_group, spec.vocab, label_smoothing)

    model = PipelineModule(layers, ctx.pp_size, ctx.pp_rank, loss_fn, partition, chunks=chunks,
                           flops_fn=lambda layer: layer.flops_per_token)
    if spec.tie_embeddings:
        mods = [m for chunk in model.local_chunks for m in chunk]
        emb = [m for m in mods if isinstance(m, EmbeddingLayer)]
        head = [m for m in mods if isinstance(m, HeadLayer)]
        if emb and head:
            head[0].weight = emb[0].word.weight  # one parameter; both uses' gradients are summed
    model.spec = spec
    model.activation_checkpointer = activation_checkpointer
    if activation_checkpointer is not None:
        activation_checkpointer.attach(model.local_chunks)
    model.activation_shape = lambda micro_batch, seq_len: (
        seq_len // ctx.tp_size if sequence_parallel and ctx.tp_size > 1 else seq_len, micro_batch, spec.hidden)
    return model


def _wrap(builder, device, wrap_block):
    mod = builder(device)
    return wrap_block(mod) if wrap_block is not None else mod


def _flops_per_token(spec: ModelSpec, kind: str) -> float:
    """Forward+backward GEMM FLOPs per token of one layer (Megatron's counting, REFERENCE.md):
    a block 3·(24·h² + 4·s·h) = 72·h²·(1 + s/(6h)), the head 6·V·h, and the embedding a lookup
    (given a token's 2·h so that it is not free)."""
    h, s, v = spec.hidden, spec.seq_len, spec.vocab
    if kind == "block":
        return 3 * (24 * h * h + 4 * s * h)
    if kind == "head":
        return 6 * v * h
    return 2 * h
