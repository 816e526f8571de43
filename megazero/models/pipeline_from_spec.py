"""A model spec as a PipelineModule: each pipeline rank builds only its own layers.

`build_pipeline_model(spec, pctx, ...)` turns `layer_builders` (embedding, blocks, head) into layer
specs for `PipelineModule`, partitions them over `pctx.pp_size * chunks` virtual stages, and ties the
LM head to the word embedding: by sharing the parameter when both live on this rank (pp=1), else
through `tied_name` (the ZeRO optimizer sums the two copies' gradients over the embedding group).
The loss is the vocabulary-parallel cross-entropy over the TP group; activations between stages
are (s, b, h), or (s/t, b, h) under sequence parallelism (s/cp for s with context parallelism), declared to the engine ahead
(`activation_shape`), so no shape handshake is needed.
"""
from __future__ import annotations

import torch

from megazero.context_parallel import token_layout
from megazero.core.flops import layer_flops_per_token
from megazero.core.partition import LayerInfo
from megazero.core.spec import ModelSpec
from megazero.core.spec_partition import LAYER_TYPES, method_of
from megazero.models.embedding import EmbeddingLayer, HeadLayer
from megazero.models.lm import causal_lm_loss, layer_builders
from megazero.models.packed import PackedDocuments
from megazero.pipeline.pipeline_module import LayerSpec, PipelineModule
from megazero.runtime.comm import single_rank_group
from megazero.tensor_parallel import RNGStatesTracker


def build_pipeline_model(spec: ModelSpec, pctx, *, seed: int = 0, sequence_parallel: bool = False,
                         dtype: torch.dtype = torch.float32, partition="uniform", chunks: int = 1,
                         label_smoothing: float = 0.0, device=None, wrap_block=None,
                         activation_checkpointer=None, wgrad_store=None, layer_infos=None,
                         expert_tp: int | None = None, cp_method: str = "ring",
                         packed_documents: bool = False) -> PipelineModule:
    """This rank's PipelineModule for `spec` on the groups of ParallelContext `pctx` (tp_group for
    the layers, the pipeline coordinates for the partition). `wrap_block(module) -> module` may wrap
    each transformer block. `activation_checkpointer` (a
    `megazero.activation_checkpoint.ActivationCheckpointer`, exclusive with wrap_block) wraps the
    blocks (full policy) or their attention cores (selective). `wgrad_store` (a
    `megazero.tensor_parallel.weight_grad.WeightGradStore`) is given to every linear layer, for
    schedules that split backward into B and W. `partition`: a `megazero.core.partition` method name,
    or the number of transformer blocks of each virtual stage (as ``pipeline.partition`` in a config;
    the embedding joins the first stage, the head the last). `layer_infos`: `pipeline_layer_infos(spec)`
    computed once, for callers that build many ranks of one model (megazero.toolbox.model_facts); by
    default each call computes it (one meta-device build of every layer). `expert_tp`: MoE experts
    split over the TP group (the TP size, the default) or whole on every TP rank (1); the experts are
    split over ``pctx.ep_group`` (when pctx has one). With context parallelism (``pctx.cp_group`` of more than
    one rank) every stage holds this rank's s/cp tokens: the embedding and the loss take them from the whole
    sequence's tokens and labels, attention sees the whole sequence by `cp_method` (ring | ulysses).
    `packed_documents`: micro-batches carry ``doc_ids`` (`megazero.models.packed`); every stage reads them (the
    module's `on_batch`), attention stays within documents and positions restart per document."""
    attention_core = None
    if activation_checkpointer is not None:
        if wrap_block is not None:
            raise ValueError("build_pipeline_model: pass wrap_block or activation_checkpointer, not both")
        wrap_block = activation_checkpointer.wrap_block
        attention_core = activation_checkpointer.attention_core
    tracker = RNGStatesTracker(seed, pctx.tp_rank, pctx.pp_rank)
    packed = PackedDocuments() if packed_documents else None
    builders = layer_builders(spec, pctx.tp_group, seed=seed, sequence_parallel=sequence_parallel,
                              tracker=tracker, dtype=dtype, pp_rank=pctx.pp_rank, wgrad_store=wgrad_store,
                              attention_core=attention_core, ep_group=getattr(pctx, "ep_group", None),
                              expert_tp=expert_tp,
                              decisions=getattr(activation_checkpointer, "decisions", None),
                              cp_group=getattr(pctx, "cp_group", None), cp_method=cp_method, packed=packed)
    layers = [LayerSpec(_wrap, b, device, wrap_block if b.kind == "block" else None) for b in builders]
    partition = method_of(partition, [b.kind for b in builders])  # block counts -> layer counts
    infos = list(layer_infos) if layer_infos is not None else pipeline_layer_infos(spec, builders)
    tp_group, tp_size = pctx.tp_group, pctx.tp_size
    cp_group = getattr(pctx, "cp_group", None)
    cp = 1 if cp_group is None else cp_group.size

    def loss_fn(logits, labels):
        if cp == 1:
            return causal_lm_loss(logits, labels, tp_group, spec.vocab, label_smoothing)
        # this rank's share of the mean over the sequence's counted tokens: the sum over its own tokens' labels,
        # (b, s) -> (b, s/cp), over the whole count / cp (the mean over cp ranks is then the sequence's mean,
        # whichever rank's tokens the ignored labels fall on)
        counted = (labels != -100).sum().clamp(min=1)
        mine = token_layout.take(labels, 1, cp_group.rank, cp)
        return causal_lm_loss(logits, mine, tp_group, spec.vocab, label_smoothing, reduction="sum") * cp / counted

    def activation_shape(micro_batch_size: int) -> tuple[int, int, int]:
        seq = spec.seq_len // cp
        seq = seq // tp_size if sequence_parallel and tp_size > 1 else seq
        return (seq, micro_batch_size, spec.hidden)  # (s[/cp][/t], b, h)

    model = PipelineModule(layers, pctx.pp_size, pctx.pp_rank, loss_fn, partition, chunks=chunks,
                           layer_infos=infos, activation_shape=activation_shape, model_spec=spec,
                           activation_checkpointer=activation_checkpointer, wgrad_store=wgrad_store,
                           on_batch=packed.set_batch if packed is not None else None)
    if spec.tie_embeddings:
        mods = [m for chunk in model.local_chunks for m in chunk]
        emb = [m for m in mods if isinstance(m, EmbeddingLayer)]
        head = [m for m in mods if isinstance(m, HeadLayer)]
        if emb and head:
            head[0].weight = emb[0].word.weight  # one parameter; both uses' gradients are summed
    return model


def pipeline_layer_infos(spec: ModelSpec, builders=None) -> list[LayerInfo]:
    """What the partition balances, one `LayerInfo` per pipeline layer (embedding, blocks, head): type
    name, logical parameters (built on the meta device; the same for every TP size) and FLOPs per
    token. `builders` default to `layer_builders(spec)` on one TP rank."""
    if builders is None:
        builders = layer_builders(spec, single_rank_group("tp"))
    return [LayerInfo(LAYER_TYPES[b.kind], b.num_params(), layer_flops_per_token(spec, b.kind)) for b in builders]


def _wrap(builder, device, wrap_block):
    mod = builder(device)
    return wrap_block(mod) if wrap_block is not None else mod
