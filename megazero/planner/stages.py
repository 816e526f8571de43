"""Which pipeline layers each stage and chunk of a layout holds (pure: no torch).

The trainer splits a spec model's L + 2 pipeline layers (embedding, blocks, head) over pp x chunks virtual
stages by ``pipeline.partition`` (`megazero.core.spec_partition.spec_bounds`: uniform, parameters, flops,
``type:<regex>`` or a list of transformer blocks per virtual stage). The planner calls the same function
with each layer kind's logical parameter count from `layer_params` (tp 1, every expert: what the trainer's
meta-built layers count), so memory (memory_plan.py), time (stage_costs.py) and volumes (comm_volume.py) are
those of the partition the run will have, uneven ones included: the first stage holding the embedding
and the last the head and loss with fewer blocks, 70 layers over 12 stages, 126 over 16 with interleaving.
"""
from __future__ import annotations

from functools import lru_cache

from megazero.core.spec_partition import spec_bounds, stage_kinds
from megazero.planner.layer_params import layer_params


@lru_cache(maxsize=256)
def logical_params(spec) -> dict[str, int]:
    """{kind: parameters of one such layer}, the whole layer (tp 1, every expert), as the partition counts."""
    return {kind: sum(p.numel for p in layer_params(spec, kind, 1)) for kind in ("embedding", "block", "head")}


@lru_cache(maxsize=4096)
def _bounds(spec, pp: int, chunks: int, partition) -> tuple[int, ...]:
    return spec_bounds(spec, pp, chunks, partition, logical_params(spec))


def partition_bounds(spec, layout) -> tuple[int, ...]:
    """The layer boundaries of `layout`'s partition (pp·chunks + 1 indices into the L + 2 layers);
    ValueError with the trainer's message when the trainer would refuse the partition."""
    partition = layout.partition if isinstance(layout.partition, str) else tuple(layout.partition)
    return _bounds(spec, layout.pp, layout.chunks, partition)


def pipeline_layers(spec, layout) -> list[list[list[tuple[str, int]]]]:
    """[stage][chunk] -> [(kind, unit index on the stage)] of the layout's partition (virtual stage
    chunk·p + stage holds one contiguous run of the layers)."""
    kinds = stage_kinds(spec, partition_bounds(spec, layout), layout.pp, layout.chunks)
    stages = []
    for chunks in kinds:
        unit, out = 0, []
        for chunk in chunks:
            out.append([(kind, unit + i) for i, kind in enumerate(chunk)])
            unit += len(chunk)
        stages.append(out)
    return stages


def blocks_per_chunk(spec, layout) -> list[list[int]]:
    """[stage][chunk] -> the transformer blocks it holds."""
    return [[sum(kind == "block" for kind, _ in chunk) for chunk in chunks] for chunks in pipeline_layers(spec, layout)]


def chunk_shares(spec, layout) -> list[list[tuple[float, float]]]:
    """[stage][chunk] -> (its share of the stage's parameters but the routed experts, its share of the
    routed experts) on one TP rank: what a chunk's ZeRO-3 gathers and reductions carry."""
    dense = {kind: sum(p.numel for p in layer_params(spec, kind, layout.tp, layout) if not p.expert)
             for kind in ("embedding", "block", "head")}
    out = []
    for chunks in pipeline_layers(spec, layout):
        weights = [sum(dense[kind] for kind, _ in chunk) for chunk in chunks]
        blocks = [sum(kind == "block" for kind, _ in chunk) for chunk in chunks]
        out.append([(w / max(sum(weights), 1), b / sum(blocks) if sum(blocks) else 0.0)
                    for w, b in zip(weights, blocks)])
    return out
