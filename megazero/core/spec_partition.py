"""A spec model's pipeline layers and how ``pipeline.partition`` splits them (pure: no torch).

A model built from a `ModelSpec` is L + 2 pipeline layers: the embedding, L transformer blocks, the head
(`megazero.models.lm.layer_builders`). The trainer (`megazero.models.pipeline_from_spec`) and the planner
split them with the same function here, so a layout the trainer runs is the layout the planner costs:

* `layer_kinds(spec)`: ``["embedding", "block" x L, "head"]``;
* `layer_infos(spec, params)`: what the methods balance, the ``flops`` method each layer's forward +
  backward FLOPs per token (`megazero.core.flops.layer_flops_per_token`: the embedding, a lookup, 0);
* `block_counts_to_layer_counts`: ``pipeline.partition`` as a list counts transformer blocks per virtual
  stage; the embedding joins the first part, the head the last;
* `spec_bounds(spec, num_stages, chunks, method, params)`: the boundaries of `megazero.core.partition.partition`
  over those layers, given each kind's parameter count (``params``: {kind: parameters}, the logical,
  TP-independent counts; the trainer reads them off its meta-built layers, the planner off its parameter
  list; tests/test_planner_partition.py checks they agree);
* `stage_kinds`: [stage][chunk] -> the kinds of the layers it holds (virtual stage chunk·p + stage).
"""
from __future__ import annotations

import re
from typing import Sequence

from megazero.core.flops import layer_flops_per_token
from megazero.core.partition import NAMED_METHODS, LayerInfo, partition
from megazero.core.suggest import did_you_mean

LAYER_TYPES = {"embedding": "EmbeddingLayer", "block": "TransformerBlock", "head": "HeadLayer"}
"""The type name of each kind, as ``type:<regex>`` partitions match them."""


def layer_kinds(spec) -> list[str]:
    """The kinds of the L + 2 pipeline layers of `spec`, in order."""
    return ["embedding"] + ["block"] * spec.layers + ["head"]


def layer_infos(spec, params: dict[str, int]) -> list[LayerInfo]:
    """One `LayerInfo` per pipeline layer: type name, parameters (`params` by kind), forward + backward FLOPs
    per token (`megazero.core.flops.layer_flops_per_token`)."""
    return [LayerInfo(LAYER_TYPES[k], int(params[k]), layer_flops_per_token(spec, k)) for k in layer_kinds(spec)]


def block_counts_to_layer_counts(blocks: Sequence[int], kinds: list[str]) -> list[int]:
    """Per-virtual-stage counts of pipeline layers from per-stage counts of transformer blocks: the
    layers before the first block (embedding) join the first stage, those after the last (head) the
    last stage."""
    n_blocks = kinds.count("block")
    if sum(blocks) != n_blocks:
        raise ValueError(f"pipeline.partition {list(blocks)} sums to {sum(blocks)} transformer layers, "
                         f"the model has {n_blocks} (model.layers)")
    first, last = kinds.index("block"), len(kinds) - 1 - kinds[::-1].index("block")
    counts = list(blocks)
    counts[0] += first
    counts[-1] += len(kinds) - 1 - last
    return counts


def method_of(partition_method, kinds: list[str]):
    """``pipeline.partition`` as `megazero.core.partition.partition` takes it: a method name as is, a
    list (or tuple) of block counts as layer counts."""
    if isinstance(partition_method, (list, tuple)):
        return block_counts_to_layer_counts(partition_method, kinds)
    return partition_method


def spec_bounds(spec, num_stages: int, chunks: int, partition_method, params: dict[str, int]) -> tuple[int, ...]:
    """The boundaries (``num_stages·chunks + 1`` layer indices) the trainer cuts `spec`'s pipeline layers
    at; ValueError, with the trainer's message, for a partition it refuses."""
    kinds = layer_kinds(spec)
    return partition(layer_infos(spec, params), num_stages, method_of(partition_method, kinds), chunks)


def stage_kinds(spec, bounds: Sequence[int], num_stages: int, chunks: int) -> list[list[list[str]]]:
    """[stage][chunk] -> the kinds of the layers that chunk holds (virtual stage chunk·p + stage)."""
    kinds = layer_kinds(spec)
    return [[kinds[bounds[c * num_stages + s]:bounds[c * num_stages + s + 1]] for c in range(chunks)]
            for s in range(num_stages)]


def partition_problems(part, virtual_stages: int, layers: int | None, key: str = "pipeline.partition") -> list[str]:
    """Why ``pipeline.partition`` value `part` cannot split a spec model of `layers` transformer blocks (None:
    not known yet) over `virtual_stages` = pp x chunks parts, one message per problem naming `key`; [] when
    it can (a method may still be refused by `spec_bounds` for the model's layer sizes: more parts than the
    L + 2 layers). Config validation and the planner's `Layout` both ask this."""
    named = NAMED_METHODS
    if isinstance(part, str):
        if part.startswith("type:"):
            try:
                re.compile(part[5:])
            except re.error as e:
                return [f"{key}: {part!r} has an invalid regular expression ({e})"]
            return [] if part[5:] else [f"{key}: 'type:' needs a regex naming the layers to balance"]
        if part in named:
            return []
        valid = named + ("type:<regex>", "[per-stage layer counts]")
        return [f"{key}: {part!r} is not valid{did_you_mean(part, valid)} (valid: {', '.join(valid)})"]
    if not isinstance(part, (list, tuple)) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                      for n in part):
        return [f"{key}: expected a method name or a list of non-negative layer counts, got {part!r}"]
    errs = []
    if len(part) != virtual_stages:
        errs.append(f"{key}: {len(part)} layer counts for parallel.pp x pipeline.chunks = {virtual_stages} stages")
    if layers is not None and sum(part) != layers:
        errs.append(f"{key}: layer counts sum to {sum(part)}, not model.layers={layers}")
    middle = [i for i, n in enumerate(part) if n == 0 and 0 < i < len(part) - 1]
    if middle:
        errs.append(f"{key}: stage {middle[0]} has 0 transformer layers; only the first stage (which holds the "
                    f"embedding) and the last (the head) may have none")
    return errs
