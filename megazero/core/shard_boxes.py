"""Where a rank's slice of a parameter lies in the logical tensor (pure, no torch).

A rank holds, of each parameter, a flat range [a, b) of its TP shard's row-major elements (the part
of a ZeRO bucket it owns; the whole shard at stage 0). Checkpoints store such slices as *boxes* of the
logical tensor, so that any other layout can find the elements it needs:

* `tp_shard_box(full_shape, tp_dim, tp_rank, tp_size, shard_shape)`: the TP shard's box in the logical
  tensor, clipped to it (a padded vocabulary's last shard extends past the logical rows).
* `flat_range_boxes(shape, a, b)`: a flat range of a row-major tensor of at most 2 dimensions as at most
  three boxes (a partial first row, whole rows, a partial last row).
* `slice_boxes(...)`: both composed: the boxes of the logical tensor that a rank's flat range of its
  TP shard holds, each with where it sits in the flat range.
* `intersect(box_a, box_b)`: the common box, or None.

A box is (offsets, sizes), tuples of one int per dimension.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

Box = tuple[tuple[int, ...], tuple[int, ...]]


class Piece(NamedTuple):
    """Part of a flat range: elements [flat_start, flat_start + numel(shard_box)) of the range are
    `shard_box` of the TP shard, row-major; its leading `box[1]` part (the rest is padding past the
    logical tensor) is `box` of the logical tensor."""

    flat_start: int
    shard_box: Box  # in the TP shard, contiguous in the flat range
    box: Box  # in the logical tensor; sizes are a prefix of shard_box's along each dimension


def _as_2d(shape: Sequence[int]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    if len(shape) == 2:
        return shape[0], shape[1]
    raise ValueError(f"shape {tuple(shape)}: boxes are defined for tensors of at most 2 dimensions")


def tp_shard_box(full_shape: Sequence[int], tp_dim: Optional[int], tp_rank: int, tp_size: int,
                 shard_shape: Sequence[int]) -> Box:
    """The box of the logical tensor that TP shard `tp_rank` covers (clipped to the logical shape)."""
    full = tuple(full_shape)
    if tp_dim is None:
        return (0,) * len(full), full
    offsets, sizes = [0] * len(full), list(full)
    start = tp_rank * shard_shape[tp_dim]
    offsets[tp_dim] = min(start, full[tp_dim])
    sizes[tp_dim] = max(0, min(shard_shape[tp_dim], full[tp_dim] - start))
    return tuple(offsets), tuple(sizes)


def flat_range_boxes(shape: Sequence[int], a: int, b: int) -> list[tuple[int, Box]]:
    """[(position in the range, box of the tensor)] for row-major elements [a, b) of `shape`
    (at most three boxes; in the tensor's own number of dimensions)."""
    rows, cols = _as_2d(shape)
    if not 0 <= a <= b <= rows * cols:
        raise ValueError(f"flat range [{a}, {b}) outside a tensor of {rows * cols} elements")
    out: list[tuple[int, tuple[int, int, int, int]]] = []  # (pos, row0, col0, nrows, ncols)
    pos = a
    r, c = divmod(a, cols)
    if c and pos < b:  # partial first row
        n = min(cols - c, b - pos)
        out.append((pos - a, (r, c, 1, n)))
        pos += n
        r += 1
    full_rows = (b - pos) // cols
    if full_rows:
        out.append((pos - a, (r, 0, full_rows, cols)))
        pos += full_rows * cols
        r += full_rows
    if pos < b:  # partial last row
        out.append((pos - a, (r, 0, 1, b - pos)))
    if len(shape) == 2:
        return [(p, ((r0, c0), (nr, nc))) for p, (r0, c0, nr, nc) in out]
    if len(shape) == 1:
        return [(p, ((c0,), (nc,))) for p, (_, c0, _, nc) in out]
    return [(p, ((), ())) for p, _ in out]


def slice_boxes(full_shape: Sequence[int], tp_dim: Optional[int], tp_rank: int, tp_size: int,
                shard_shape: Sequence[int], a: int, b: int) -> list[Piece]:
    """The pieces of flat range [a, b) of TP shard `tp_rank` that lie inside the logical tensor
    (padding rows or columns of a padded shard are dropped)."""
    shard_box = tp_shard_box(full_shape, tp_dim, tp_rank, tp_size, shard_shape)
    (origin, valid) = shard_box
    start = tuple(o - (tp_rank * shard_shape[tp_dim] if d == tp_dim else 0) for d, o in enumerate(origin))
    inside: Box = (tuple(0 for _ in start), valid)  # the valid part, in shard coordinates
    pieces = []
    for pos, box in flat_range_boxes(shard_shape, a, b):
        common = intersect(box, inside)
        if common is None or numel(common) == 0:
            continue
        if common[0] != box[0]:
            raise ValueError(f"shard {tuple(shard_shape)}: padding must follow the valid part, {box} vs {inside}")
        offsets = tuple(o + (tp_rank * shard_shape[tp_dim] if d == tp_dim else 0) for d, o in enumerate(box[0]))
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
    n = 1
    for s in box[1]:
        n *= s
    return n
