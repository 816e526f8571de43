"""`ModelFacts`: what the planner needs to know of a model on a layout, as plain numbers.

Made by `megazero.toolbox.model_facts.model_facts(spec, tp, pp, chunks)` from the model built on the
meta device (so the counts are those of megazero's real layers: padded vocabulary, biases, norms,
tied embeddings), and handed to the planner, which never imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageFacts:
    """One pipeline rank (all its chunks), seen from one TP rank.

    layers: transformer blocks on this pipeline rank; params: parameters this TP rank holds here
    (its shards of TP-split weights and full copies of replicated ones); tied_params: of those, the
    word embedding / LM head copies tied across the first and last stage (pp > 1: their own flat
    group); embedding / head: whether the word embedding / the LM head live here; expert_params: of
    `params`, the routed experts of Mixture-of-Experts layers as the meta build holds them (every
    expert: ep = 1), each expert's ffn split over `expert_tp` TP ranks."""

    stage: int
    layers: int
    params: int
    tied_params: int = 0
    embedding: bool = False
    head: bool = False
    expert_params: int = 0
    expert_tp: int = 1


@dataclass(frozen=True)
class ModelFacts:
    """total_params: the logical model (tied weights once, vocabulary unpadded); stages: one
    `StageFacts` per pipeline rank, for TP rank 0 (TP ranks hold equal shards)."""

    total_params: int
    stages: tuple[StageFacts, ...]
