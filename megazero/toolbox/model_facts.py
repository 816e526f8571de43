"""What each rank of a TP x PP layout holds, read off the layers it builds, on the meta device.

`model_facts(spec, tp, pp, chunks=1, partition="uniform", sequence_parallel=False)` returns the
`megazero.planner.facts.ModelFacts` the planner reads: per pipeline rank (all its chunks) the
transformer blocks, the parameters one TP rank holds (its shards of split weights, padded vocabulary
rows included, and full copies of replicated ones), the tied embedding / LM head copies, and whether
the word embedding / the head live there; `total_params` is the logical model (tied weights once,
vocabulary unpadded). `rank_shards(...)` gives every (pp rank, tp rank)'s parameters as `ShardFacts`
(logical name, local and full shape, split dim), from which a test can put the full model back
together; `build_ranks(...)` returns both views of one build.

How. Each (pp rank s, tp rank r) runs the trainer's own builder, `build_pipeline_model`, on the meta
device with a stand-in for its ParallelContext: a TP group handle without a process group (building
a layer communicates nothing) and the pipeline coordinates. So the layers, the partition over
``pp * chunks`` virtual stages (the embedding joins the first, the head the last), the tying of the
head to the embedding (one parameter when both are on one rank, copies with `tied_name` when pp > 1)
are those of a real run, and nothing is allocated. Data-parallel replicas build the same layers, so
the tp x pp distinct ranks describe a layout of any dp: tp=8 x pp=16 x dp=16 is 2048 ranks of 128
distinct ones. The per-layer counts the partition balances are computed once (`pipeline_layer_infos`).
Every TP rank is built and compared: TP ranks must hold equal parameter counts (ZeRO and the planner
rely on it), else RuntimeError.

Cost, 2 CPU cores: GPT-3 175B at tp=8, pp=16 and Llama-3 405B at tp=8, pp=18 take a few seconds each
(tests/test_model_facts.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from math import prod

import torch

from megazero.core.spec import ModelSpec
from megazero.core.spec_partition import layer_kinds, spec_bounds, stage_kinds
from megazero.models.block import TransformerBlock
from megazero.models.embedding import EmbeddingLayer, HeadLayer
from megazero.models.lm import layer_builders
from megazero.models.pipeline_from_spec import build_pipeline_model, pipeline_layer_infos
from megazero.planner.facts import ModelFacts, StageFacts
from megazero.runtime.comm import CommStats, GroupHandle
from megazero.tensor_parallel.params import num_logical_params


@dataclass(frozen=True)
class ShardFacts:
    """One parameter as a rank holds it. shape: the local shard (the vocabulary split includes
    padding rows); full_shape: the logical parameter, unpadded; tp_dim: the dim split over the TP
    group (None: replicated); tied: a word embedding / LM head copy tied across the first and last
    pipeline stage (pp > 1); sequence_parallel: its gradient is a partial sum per TP rank; expert: a
    Mixture-of-Experts layer's routed experts (the meta build holds every expert: ep = 1)."""

    name: str
    shape: tuple[int, ...]
    full_shape: tuple[int, ...]
    tp_dim: int | None
    tp_rank: int
    tp_size: int
    tied: bool = False
    sequence_parallel: bool = False
    expert: bool = False

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class RankFacts:
    """One (pp rank, tp rank): blocks, embedding / head presence, and its parameters in build order."""

    pp_rank: int
    tp_rank: int
    layers: int
    embedding: bool
    head: bool
    shards: tuple[ShardFacts, ...]

    def stage_facts(self) -> StageFacts:
        """The planner's view; expert_tp: the TP split of the routed experts' ffn, their weight matrices'
        logical (whole) size over what this rank holds of them."""
        experts = [p for p in self.shards if p.expert]
        mats = [p for p in experts if len(p.full_shape) == 3]  # (E, f, h) / (E, h, f); biases are (E, n)
        held = sum(p.numel for p in mats)
        return StageFacts(stage=self.pp_rank, layers=self.layers, params=sum(p.numel for p in self.shards),
                          tied_params=sum(p.numel for p in self.shards if p.tied),
                          embedding=self.embedding, head=self.head, expert_params=sum(p.numel for p in experts),
                          expert_tp=sum(prod(p.full_shape) for p in mats) // held if held else 1)


@dataclass(frozen=True)
class _MetaRank:
    """What `build_pipeline_model` reads of a ParallelContext, for one rank, without processes."""

    tp_group: GroupHandle
    pp_rank: int
    pp_size: int

    @property
    def tp_rank(self) -> int:
        return self.tp_group.rank

    @property
    def tp_size(self) -> int:
        return self.tp_group.size


def fake_tp_group(tp: int, rank: int) -> GroupHandle:
    """TP rank `rank` of `tp` without a process group: enough to build layers (on the meta device)."""
    return GroupHandle("tp", tuple(range(tp)), rank, None, CommStats())


def build_ranks(spec: ModelSpec, tp: int, pp: int, chunks: int = 1, partition="uniform",
                sequence_parallel: bool = False) -> dict[tuple[int, int], RankFacts]:
    """{(pp rank, tp rank): RankFacts} of every distinct rank (see the module docstring)."""
    spec.validate_layout(tp, sequence_parallel)
    infos = pipeline_layer_infos(spec)
    out = {}
    for s in range(pp):
        for r in range(tp):
            model = build_pipeline_model(spec, _MetaRank(fake_tp_group(tp, r), s, pp), sequence_parallel=sequence_parallel,
                                         partition=partition, chunks=chunks, device="meta", layer_infos=infos)
            mods = [m for chunk in model.local_chunks for m in chunk]
            shards = tuple(ShardFacts(p.logical_name, tuple(p.shape), tuple(p.full_shape), p.tp_dim, p.tp_rank,
                                      p.tp_size, pp > 1 and getattr(p, "tied_name", None) is not None,
                                      bool(p.sequence_parallel), bool(getattr(p, "expert", False)))
                           for p in model.parameters())  # each parameter object once (pp=1 tie: one)
            out[s, r] = RankFacts(s, r, sum(isinstance(m, TransformerBlock) for m in mods),
                                  any(isinstance(m, EmbeddingLayer) for m in mods),
                                  any(isinstance(m, HeadLayer) for m in mods), shards)
    return out


def rank_shards(spec: ModelSpec, tp: int, pp: int, chunks: int = 1, partition="uniform",
                sequence_parallel: bool = False) -> dict[tuple[int, int], tuple[ShardFacts, ...]]:
    """{(pp rank, tp rank): the parameters that rank holds} (see `ShardFacts`)."""
    ranks = build_ranks(spec, tp, pp, chunks, partition, sequence_parallel)
    return {k: v.shards for k, v in ranks.items()}


def facts_of(ranks: dict[tuple[int, int], RankFacts]) -> ModelFacts:
    """`ModelFacts` of `build_ranks`' result: TP rank 0's view of each pipeline rank, after checking
    that every TP rank's view is the same; total_params over the logical names of all ranks."""
    pp = 1 + max(s for s, _ in ranks)
    stages = []
    for s in range(pp):
        views = {r: f.stage_facts() for (st, r), f in sorted(ranks.items()) if st == s}
        if len(set(views.values())) != 1:
            raise RuntimeError(f"pipeline rank {s}: TP ranks hold different parameters: {views}")
        stages.append(views[0])
    full: dict[str, tuple[int, ...]] = {}
    for f in ranks.values():
        for p in f.shards:
            if full.setdefault(p.name, p.full_shape) != p.full_shape:
                raise RuntimeError(f"{p.name}: full shape {p.full_shape} here, {full[p.name]} elsewhere")
    return ModelFacts(total_params=sum(prod(shape) for shape in full.values()), stages=tuple(stages))


def model_facts(spec: ModelSpec, tp: int, pp: int, chunks: int = 1, partition="uniform",
                sequence_parallel: bool = False) -> ModelFacts:
    """The planner's `ModelFacts` of `spec` on tp x pp (any dp); `partition` and `chunks` as
    ``pipeline.partition`` and ``pipeline.chunks``.

    Equal to ``facts_of(build_ranks(...))`` (tests/test_model_facts.py) at a fraction of its cost: a spec's
    blocks are all alike, so each TP rank builds one embedding, one block and one head with the trainer's
    layer builders on the meta device, and a pipeline rank's facts are the sum over the layers the trainer's
    partition (`megazero.core.spec_partition.spec_bounds`, with the built layers' logical parameter counts)
    gives it, the head's weight counted once where it is the embedding's (pp = 1) and as a tied copy on
    both ends otherwise (pp > 1), as `build_pipeline_model` ties them."""
    spec.validate_layout(tp, sequence_parallel)
    kinds = layer_kinds(spec)
    per_rank = [_built_kinds(spec, tp, r, sequence_parallel) for r in range(tp)]
    logical = {kind: num for kind, (_, num) in per_rank[0].items()}
    bounds = spec_bounds(spec, pp, chunks, partition, logical)
    stages = []
    for s, on_stage in enumerate(stage_kinds(spec, bounds, pp, chunks)):
        held = [kind for chunk in on_stage for kind in chunk]
        views = {r: _stage_view(s, pp, held, built, spec.tie_embeddings) for r, built in enumerate(per_rank)}
        if len(set(views.values())) != 1:
            raise RuntimeError(f"pipeline rank {s}: TP ranks hold different parameters: {views}")
        stages.append(views[0])
    full = {p.name: prod(p.full_shape) for kind in ("embedding", "head") for p in per_rank[0][kind][0]}
    block = sum(prod(p.full_shape) for p in per_rank[0]["block"][0]) if "block" in kinds else 0
    return ModelFacts(total_params=sum(full.values()) + spec.layers * block, stages=tuple(stages))


def _built_kinds(spec: ModelSpec, tp: int, rank: int, sequence_parallel: bool) -> dict:
    """{kind: (its parameters on TP rank `rank` as `ShardFacts` (tied: carries a tied name), its logical
    parameter count)} of the first layer of each kind, built on the meta device."""
    builders = layer_builders(spec, fake_tp_group(tp, rank), sequence_parallel=sequence_parallel)
    out = {}
    for b in builders:
        if b.kind in out:
            continue
        params = list(b.make(torch.device("meta")).parameters())
        shards = tuple(ShardFacts(p.logical_name, tuple(p.shape), tuple(p.full_shape), p.tp_dim, p.tp_rank, p.tp_size,
                                  getattr(p, "tied_name", None) is not None, bool(p.sequence_parallel),
                                  bool(getattr(p, "expert", False))) for p in params)
        out[b.kind] = (shards, num_logical_params(params))
    return out


def _stage_view(stage: int, pp: int, held: list[str], built: dict, tied_model: bool):
    """The `StageFacts` of a pipeline rank holding the layers `held` (kinds), from one TP rank's `built`."""
    shared = pp == 1 and tied_model and "head" in held and "embedding" in held  # the head's weight is the embedding's
    shards = [p for kind in held for p in built[kind][0] if not (shared and kind == "head" and p.tied)]
    if pp == 1:
        shards = [dataclasses.replace(p, tied=False) if p.tied else p for p in shards]
    return RankFacts(stage, shards[0].tp_rank if shards else 0, held.count("block"), "embedding" in held,
                     "head" in held, tuple(shards)).stage_facts()
