"""Where a rank's slice of a parameter lies in the logical tensor (pure, no torch).

A rank holds, of each parameter, a flat range [a, b) of its shard's row-major elements (the part of
a ZeRO bucket it owns; the whole shard at stage 0). The shard is the logical tensor cut along one
or more split dims (a TP shard along tp_dim; an MoE expert tensor (E, f, h) along dim 0 over the
expert-parallel group AND along f over the TP group). Checkpoints store such slices as *boxes* of
the logical tensor, so that any other layout can find the elements it needs:

* `shard_box(full_shape, splits, shard_shape)`: the shard's box in the logical tensor, clipped to it
  (a padded vocabulary's last shard extends past the logical rows); `splits` lists
  (dim, rank, ranks) for each split dim.
* `flat_range_boxes(shape, a, b)`: a flat range of a row-major tensor of N dimensions as at most
  2·N − 1 boxes (N ≥ 1): along each dim but the first, a partial head and a partial tail, and one
  box of whole rows of the first dim between them.
* `slice_boxes(...)`: both composed: the boxes of the logical tensor that a rank's flat range of its
  shard holds, each with where it sits in the flat range.
* `intersect(box_a, box_b)`: the common box, or None.

A box is (offsets, sizes), tuples of one int per dimension.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

Box = tuple[tuple[int, ...], tuple[int, ...]]
Split = tuple[int, int, int]  # (dim, this rank's index, ranks)


class Piece(NamedTuple):
    """Part of a flat range: elements [flat_start, flat_start + numel(shard_box)) of the range are
    `shard_box` of the shard, row-major; its leading `box[1]` part (the rest is padding past the
    logical tensor) is `box` of the logical tensor."""

    flat_start: int
    shard_box: Box  # in the shard, contiguous in the flat range
    box: Box  # in the logical tensor; sizes are a prefix of shard_box's along each dimension


def _prod(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def shard_box(full_shape: Sequence[int], splits: Sequence[Split], shard_shape: Sequence[int]) -> Box:
    """The box of the logical tensor that the shard of `splits` covers (clipped to the logical shape)."""
    full = tuple(full_shape)
    offsets, sizes = [0] * len(full), list(full)
    for dim, rank, _ in splits:
        start = rank * shard_shape[dim]
        offsets[dim] = min(start, full[dim])
        sizes[dim] = max(0, min(shard_shape[dim], full[dim] - start))
    return tuple(offsets), tuple(sizes)


def flat_range_boxes(shape: Sequence[int], a: int, b: int) -> list[tuple[int, Box]]:
    """[(position in the range, box of the tensor)] for row-major elements [a, b) of `shape`
    (at most 2·N − 1 boxes for N dims, in the tensor's own number of dimensions; a 0-d tensor is one
    empty box)."""
    shape = tuple(int(n) for n in shape)
    total = _prod(shape)
    if not 0 <= a <= b <= total:
        raise ValueError(f"flat range [{a}, {b}) outside a tensor of {total} elements")
    if a == b:
        return []
    if not shape:
        return [(0, ((), ()))]
    return [(pos - a, box) for pos, box in _boxes(shape, a, b)]


def _boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple[int, Box]]:
    """(flat position, box) of [a, b) (non-empty) of a row-major `shape` of at least one dim."""
    if len(shape) == 1:
        return [(a, ((a,), (b - a,)))]
    rest = shape[1:]
    inner = _prod(rest)
    r0, c0 = divmod(a, inner)
    r1, c1 = divmod(b, inner)

    def within(row: int, lo: int, hi: int) -> list[tuple[int, Box]]:  # part of one row of dim 0
        return [(row * inner + p, ((row,) + o, (1,) + s)) for p, (o, s) in _boxes(rest, lo, hi)]

    if r0 == r1:
        return within(r0, c0, c1)
    out = []
    if c0:  # partial first row
        out += within(r0, c0, inner)
        r0 += 1
    if r1 > r0:  # whole rows
        out.append((r0 * inner, ((r0,) + (0,) * len(rest), (r1 - r0,) + rest)))
    if c1:  # partial last row
        out += within(r1, 0, c1)
    return out


def slice_boxes(full_shape: Sequence[int], splits: Sequence[Split], shard_shape: Sequence[int],
                a: int, b: int) -> list[Piece]:
    """The pieces of flat range [a, b) of the shard of `splits` that lie inside the logical tensor
    (padding rows or columns of a padded shard are dropped)."""
    origin, valid = shard_box(full_shape, splits, shard_shape)
    base = [0] * len(origin)  # the shard's first element, in logical coordinates (may pass the end: padding)
    for dim, rank, _ in splits:
        base[dim] = rank * shard_shape[dim]
    start = tuple(o - s for o, s in zip(origin, base))
    inside: Box = (tuple(0 for _ in start), valid)  # the valid part, in shard coordinates
    pieces = []
    for pos, box in flat_range_boxes(shard_shape, a, b):
        common = intersect(box, inside)
        if common is None or numel(common) == 0:
            continue
        if common[0] != box[0]:
            raise ValueError(f"shard {tuple(shard_shape)}: padding must follow the valid part, {box} vs {inside}")
        offsets = tuple(o + s for o, s in zip(box[0], base))
        pieces.append(Piece(pos, box, (offsets, common[1])))
    return pieces


def intersect(a: Box, b: Box) -> Optional[Box]:
    """The box common to `a` and `b`, or None when they do not overlap."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(h <= l for l, h in zip(lo, hi)):
        return None if lo else (lo, ())
    return lo, tuple(h - l for l, h in zip(lo, hi))


def numel(box: Box) -> int:
    return _prod(box[1])
