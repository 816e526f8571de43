"""Boxes of N-dimensional shards (megazero/core/shard_boxes.py), pure, and the checkpoint reader's
boxes of the first MoE checkpoints (3-D experts stored as 2-D boxes of (E, f·h)).

- a flat range of a row-major tensor of N dims is at most 2·N − 1 boxes, disjoint, in order, whose
  elements are exactly the range's;
- a flat range of a shard split along one or two dims (MoE experts: the expert dim over ep, the ffn
  over TP), padded or not, maps to the logical tensor's elements;
- `copy_overlaps` reads boxes written in the tensor's own dims and legacy flattened ones alike.
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from megazero.checkpoint.read import copy_overlaps
from megazero.core.shard_boxes import flat_range_boxes, numel, slice_boxes


def _index(box):
    return tuple(slice(o, o + n) for o, n in zip(*box, strict=True))


SHAPES = [(), (7,), (3, 5), (4, 3, 5), (2, 3, 2, 4), (1, 6, 1), (3, 0, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_flat_range_is_few_boxes_holding_exactly_its_elements(shape):
    t = torch.arange(torch.Size(shape).numel()).view(shape)
    n = t.numel()
    rng = random.Random(len(shape))
    ranges = [(a, b) for a, b in itertools.combinations_with_replacement(range(n + 1), 2)]
    for a, b in rng.sample(ranges, min(len(ranges), 300)):
        boxes = flat_range_boxes(shape, a, b)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        got, pos = [], 0
        for p, box in boxes:
            assert p == pos and len(box[0]) == len(shape)
            got.append(t[_index(box)].reshape(-1))
            pos += numel(box)
        assert pos == b - a
        assert torch.equal(torch.cat(got) if got else torch.empty(0, dtype=t.dtype), t.reshape(-1)[a:b])


@pytest.mark.parametrize("full,splits,shard", [
    ((8, 6, 5), [(0, 1, 2), (1, 1, 2)], (4, 3, 5)),  # experts over ep (dim 0) and their ffn over TP (dim 1)
    ((8, 5, 6), [(0, 3, 4), (2, 0, 2)], (2, 5, 3)),  # down / fc2 (E, h, f): ffn on dim 2
    ((8, 6), [(0, 1, 2), (1, 2, 3)], (4, 2)),  # a bias (E, f)
    ((5, 3), [(0, 1, 2)], (3, 3)),  # a padded vocabulary: the last shard's last row is padding
    ((5, 3), [], (5, 3)),
])
def test_a_shards_flat_range_lands_on_the_logical_elements(full, splits, shard):
    logical = torch.arange(torch.Size(full).numel()).view(full)
    padded = [n for n in full]
    for dim, _, ranks in splits:
        padded[dim] = shard[dim] * ranks
    whole = torch.full(padded, -1, dtype=logical.dtype)
    whole[_index(((0,) * len(full), full))] = logical
    index = [slice(None)] * len(full)
    for dim, rank, _ in splits:
        index[dim] = slice(rank * shard[dim], (rank + 1) * shard[dim])
    mine = whole[tuple(index)].reshape(-1)  # this rank's shard, row-major, padding -1
    n = mine.numel()
    for a, b in [(0, n), (1, n - 1), (n // 3, 2 * n // 3), (5, 6), (n - 4, n)]:
        pieces = slice_boxes(full, splits, shard, a, b)
        covered = 0
        for piece in pieces:
            held = mine[a + piece.flat_start:a + piece.flat_start + numel(piece.shard_box)].view(piece.shard_box[1])
            held = held[tuple(slice(0, k) for k in piece.box[1])]
            assert torch.equal(held, logical[_index(piece.box)])
            covered += numel(piece.box)
        assert covered == int((mine[a:b] >= 0).sum())  # every valid element once, the padding none


class _Readers:
    """Stored tensors in memory, read like `megazero.checkpoint.sharded.Readers`."""

    def __init__(self, tensors):
        self.tensors = tensors

    def slice(self, fname, key, index):
        return self.tensors[key][index]


def test_legacy_flattened_expert_boxes_still_load():
    """The first MoE checkpoints stored experts (E, f, h) as 2-D boxes of (E, f·h) (ZeRO's flat ranges
    cut anywhere): `copy_overlaps` reads any 3-D box out of them, as out of 3-D boxes."""
    shape = (4, 3, 5)
    logical = torch.randn(shape)
    flat = logical.view(4, 15)
    legacy, nd, tensors = [], [], {}
    cuts = [0, 7, 22, 38, 41, 60]
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
        for pos, box in flat_range_boxes((4, 15), a, b):
            key = f"old/{i}/{pos}"
            tensors[key] = flat[_index(box)].clone()
            legacy.append({"file": "rank0", "key": key, "offsets": list(box[0]), "sizes": list(box[1])})
        for pos, box in flat_range_boxes(shape, a, b):
            key = f"new/{i}/{pos}"
            tensors[key] = logical[_index(box)].clone()
            nd.append({"file": "rank0", "key": key, "offsets": list(box[0]), "sizes": list(box[1])})
    readers = _Readers(tensors)
    for box in [((0, 0, 0), shape), ((1, 1, 2), (2, 2, 3)), ((3, 2, 4), (1, 1, 1)), ((0, 1, 0), (4, 1, 5))]:
        for records in (legacy, nd):
            dest = torch.empty(box[1])
            assert copy_overlaps(readers, records, box, dest, shape) == numel(box)
            assert torch.equal(dest, logical[_index(box)])
