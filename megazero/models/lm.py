"""The language model as a sequence of layers, for pipeline stages and for pp=1.

`layer_builders(spec, tp_group, ...)` returns L+2 `LayerBuilder`s, in order:

    embedding       tokens (b, s)  -> hidden (s, b, h)
    layers.0 .. L-1 hidden         -> hidden          (TransformerBlock, global index i)
    head            hidden         -> logits shard (s, b, Vp/t)

Each builder constructs ONE layer lazily, on a device of the caller's choice, from its global index,
so a pipeline stage builds only its own layers and gets the same values as any other layout (see
`megazero.tensor_parallel.init`). Under sequence parallelism hidden states are (s/t, b, h).
`causal_lm_loss` turns the logits shard and labels (b, s) into the mean loss over non-ignored tokens
without gathering the logits. `CausalLM` (pp=1) builds all layers, ties the head to the embedding
when the spec says so, and returns the loss.

Labels are aligned with tokens (labels[:, j] is the target at position j); shift them in the data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from megazero.runtime.comm import GroupHandle, single_rank_group
from megazero.models.attention import AlibiBias, alibi_slopes
from megazero.models.block import TransformerBlock
from megazero.models.common import LayerContext
from megazero.models.packed import PackedDocuments
from megazero.models.rope import RopeTables
from megazero.models.embedding import EmbeddingLayer, HeadLayer
from megazero.core.spec import ModelSpec
from megazero.tensor_parallel.weight_grad import WeightGradStore
from megazero.tensor_parallel import (RNGStatesTracker, num_logical_params, sync_sequence_parallel_grads,
                                      unique_params, vocab_parallel_cross_entropy)


@dataclass(frozen=True, eq=False)
class LayerBuilder:
    """Builds one layer: ``builder(device) -> nn.Module``. `kind` is embedding | block | head;
    `index` is the global block index (None for embedding and head)."""

    name: str
    kind: str
    index: int | None
    make: Callable[[torch.device], nn.Module]

    def __call__(self, device=None) -> nn.Module:
        return self.make(device)

    def num_params(self) -> int:
        """Logical parameters of this layer (built on the meta device, nothing allocated)."""
        return num_logical_params(self.make(torch.device("meta")).parameters())


def layer_builders(spec: ModelSpec, tp_group: GroupHandle, *, seed: int = 0, sequence_parallel: bool = False,
                   tracker: RNGStatesTracker | None = None, dtype: torch.dtype = torch.float32,
                   pp_rank: int = 0, wgrad_store: WeightGradStore | None = None,
                   attention_core: Callable[[str], Callable | None] | None = None,
                   ep_group: GroupHandle | None = None, expert_tp: int | None = None,
                   decisions=None, cp_group: GroupHandle | None = None, cp_method: str = "ring",
                   packed: PackedDocuments | None = None) -> list[LayerBuilder]:
    """The model's layers as lazy factories (see the module docstring). Validates the layout first.

    `tracker` holds the dropout streams; by default one seeded with (seed, tp rank, `pp_rank`) shared
    by the returned layers. `wgrad_store` goes to every linear layer (zero bubble);
    `attention_core(name)` gives each attention its selective-checkpoint wrapper (see
    `ActivationCheckpointer.attention_core`). MoE models (``spec.moe``): `ep_group` splits the experts
    (None: all of them on every rank); `expert_tp` (1 or the TP size; None: the TP size) splits each
    expert's ffn over the TP group (expert tensor parallelism) or not (1: whole experts on every TP
    rank); `decisions` (an `ActivationCheckpointer`'s) lets a recompute replay the routing; each MoE
    layer's aux-loss scale is set by the engine that runs it (`megazero.moe.layer.set_aux_loss_scale`).
    `cp_group` (context parallelism, more than one rank): each layer holds this rank's seq/cp tokens and attention
    sees the whole sequence by `cp_method` (`megazero.context_parallel`); None or one rank: the whole sequence.
    `packed` (packed documents, `megazero.models.packed`): the holder of the current micro-batch's documents,
    which attention and positions follow; None: one document per sample.
    """
    spec.validate_layout(tp_group.size, sequence_parallel)
    expert_tp_group = _expert_tp_group(tp_group, expert_tp)
    tracker = tracker or RNGStatesTracker(seed, tp_group.rank, pp_rank)
    rope = RopeTables(spec.head_dim, spec.rope_theta) if spec.position == "rope" else None  # shared by the layers
    alibi = None
    if spec.position == "alibi":  # this TP rank's heads' slopes, one mask for every layer
        local = spec.heads // tp_group.size
        alibi = AlibiBias(alibi_slopes(spec.heads)[tp_group.rank * local:(tp_group.rank + 1) * local])

    def make_lctx(device) -> LayerContext:
        device = torch.device(device) if device is not None else torch.device("cpu")
        return LayerContext(spec, tp_group, seed, sequence_parallel and tp_group.size > 1, tracker, device, dtype,
                            wgrad_store, attention_core, rope, ep_group, expert_tp_group, decisions, alibi,
                            cp_group if cp_group is not None and cp_group.size > 1 else None, cp_method, packed)

    def block(i):
        return LayerBuilder(f"layers.{i}", "block", i, lambda device: TransformerBlock(make_lctx(device), i))

    return ([LayerBuilder("embedding", "embedding", None, lambda device: EmbeddingLayer(make_lctx(device)))]
            + [block(i) for i in range(spec.layers)]
            + [LayerBuilder("head", "head", None, lambda device: HeadLayer(make_lctx(device)))])


def _expert_tp_group(tp_group: GroupHandle, expert_tp: int | None) -> GroupHandle | None:
    """The group MoE experts are split over: `tp_group` when `expert_tp` is its size (or None), None
    (whole experts) when 1; another value is an error naming ``parallel.expert_tp``."""
    t = tp_group.size
    if expert_tp is None or expert_tp == t:
        return tp_group if t > 1 else None
    if expert_tp == 1:
        return None
    raise ValueError(f"parallel.expert_tp={expert_tp!r}: must be 1 (experts whole on every TP rank) or the "
                     f"tensor-parallel size {t} (each expert's ffn split over the TP group)")


def causal_lm_loss(logits_shard: torch.Tensor, labels: torch.Tensor, tp_group: GroupHandle, vocab_size: int,
                   label_smoothing: float = 0.0, ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Loss of logits shard (s, b, Vp/t) against labels (b, s); mean over non-ignored tokens by default.
    Communication: the two small all-reduces of `vocab_parallel_cross_entropy` over `tp_group`."""
    return vocab_parallel_cross_entropy(logits_shard, labels.t(), tp_group, vocab_size,  # labels (s, b)
                                        label_smoothing=label_smoothing, ignore_index=ignore_index,
                                        reduction=reduction)


class CausalLM(nn.Module):
    """The whole model on one pipeline stage (pp=1): embedding, blocks, head, loss.

    `forward(tokens, labels=None)`: tokens (b, s) -> logits shard (s, b, Vp/t); with labels (b, s),
    returns (loss, logits shard). Under sequence parallelism call `finish_grad_sync()` after the last
    backward of a step (it all-reduces the partial gradients of sequence-parallel parameters).
    Named parameters equal logical names, except the tied head weight, which is the embedding's.
    """

    def __init__(self, spec: ModelSpec, tp_group: GroupHandle, *, seed: int = 0, sequence_parallel: bool = False,
                 tracker: RNGStatesTracker | None = None, device=None, dtype: torch.dtype = torch.float32,
                 label_smoothing: float = 0.0):
        super().__init__()
        self.spec, self.tp_group, self.label_smoothing = spec, tp_group, label_smoothing
        self.sequence_parallel = sequence_parallel and tp_group.size > 1
        self.tracker = tracker or RNGStatesTracker(seed, tp_group.rank)
        builders = layer_builders(spec, tp_group, seed=seed, sequence_parallel=sequence_parallel,
                                  tracker=self.tracker, dtype=dtype)
        self.embedding = builders[0](device)
        self.layers = nn.ModuleList(b(device) for b in builders[1:-1])
        self.head = builders[-1](device)
        if spec.tie_embeddings:
            self.head.weight = self.embedding.word.weight  # one parameter, gradients of both uses summed

    def stages(self) -> list[nn.Module]:
        """The layers in order (embedding, blocks..., head)."""
        return [self.embedding, *self.layers, self.head]

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None):
        h = self.embedding(tokens)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)  # (s, b, Vp/t)
        if labels is None:
            return logits
        loss = causal_lm_loss(logits, labels, self.tp_group, self.spec.vocab, self.label_smoothing)
        return loss, logits

    def finish_grad_sync(self) -> int:
        """All-reduce over the TP group the gradients of sequence-parallel parameters (see
        `megazero.tensor_parallel.sync_sequence_parallel_grads`); a no-op without sequence parallelism."""
        return sync_sequence_parallel_grads(self, self.tp_group) if self.sequence_parallel else 0

    def num_params(self) -> int:
        return num_logical_params(unique_params(self))



def count_params(spec: ModelSpec) -> int:
    """Logical parameter count of `spec` (tied embeddings once), from the model built on the meta device."""
    return CausalLM(spec, single_rank_group("tp"), device="meta").num_params()
