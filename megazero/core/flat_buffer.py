"""Pure index math for ZeRO's flat buffers: where each parameter lives, how the buffer is cut into
buckets, and which slice of every bucket each data-parallel rank owns.

Layout: parameters are placed one after another in the order given (callers pass them in the order
their gradients become ready, i.e. reverse forward order, so the first bucket fills first). A
parameter never straddles buckets; a bucket closes once it holds at least `bucket_size` elements or
at a forced boundary (ZeRO-3 cuts buckets at layer boundaries). Every bucket is padded at its end to
a multiple of `dp_size`, so rank r's shard of a bucket is the r-th of dp_size equal slices and every
rank owns the same number of elements. A rank's whole shard is the concatenation of its bucket slices.

No torch here: offsets are ints, so the math is testable alone for any size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Bucket:
    """A range [start, end) of the flat buffer; `end - start` is a multiple of the dp size."""

    index: int
    start: int
    end: int
    params: tuple[int, ...]  # indices of the parameters inside

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """Buffer range [start, end) that `dp_rank` owns in this bucket."""
        n = self.numel // dp_size
        return self.start + dp_rank * n, self.start + (dp_rank + 1) * n


@dataclass(frozen=True)
class Segment:
    """The part of parameter `param` that falls inside a shard: buffer range and range in the
    parameter's own flattened storage."""

    param: int
    buf_start: int
    buf_end: int
    param_start: int

    @property
    def numel(self) -> int:
        return self.buf_end - self.buf_start


@dataclass(frozen=True)
class FlatLayout:
    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    dp_size: int
    bucket_index: tuple[int, ...]  # per parameter: the bucket that holds it (an O(1) lookup in the grad hook)

    @property
    def total(self) -> int:
        """Padded length of the flat buffer."""
        return self.buckets[-1].end if self.buckets else 0

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns (the same on every rank)."""
        return self.total // self.dp_size

    @property
    def padding(self) -> int:
        return self.total - sum(self.numels)

    def param_range(self, i: int) -> tuple[int, int]:
        return self.offsets[i], self.offsets[i] + self.numels[i]

    def bucket_of(self, i: int) -> int:
        """Index of the bucket that holds parameter `i`."""
        if not 0 <= i < len(self.bucket_index):
            raise IndexError(f"parameter {i} is not in any bucket (the layout has {len(self.numels)} parameters)")
        return self.bucket_index[i]

    def shard_ranges(self, dp_rank: int) -> list[tuple[int, int]]:
        """Buffer ranges rank `dp_rank` owns, one per bucket, in bucket order."""
        return [b.shard(dp_rank, self.dp_size) for b in self.buckets]

    def segments(self, bucket: Bucket, dp_rank: int) -> list[Segment]:
        """The pieces of parameters inside `dp_rank`'s shard of `bucket` (padding excluded)."""
        return self.segments_between(bucket, *bucket.shard(dp_rank, self.dp_size))

    def segments_between(self, bucket: Bucket, lo: int, hi: int) -> list[Segment]:
        """The pieces of `bucket`'s parameters inside buffer range [lo, hi)."""
        out = []
        for i in bucket.params:
            p_lo, p_hi = self.param_range(i)
            s, e = max(lo, p_lo), min(hi, p_hi)
            if s < e:
                out.append(Segment(i, s, e, s - p_lo))
        return out


def build_layout(numels: Sequence[int], dp_size: int, bucket_size: int,
                 boundaries: Sequence[int] = ()) -> FlatLayout:
    """Place parameters of the given sizes in buckets of at least `bucket_size` elements.

    Args:
        numels: element count of each parameter, in buffer order.
        dp_size: number of data-parallel ranks sharing the buffer (buckets pad to a multiple of it).
        bucket_size: a bucket closes once it holds at least this many elements (> 0).
        boundaries: parameter indices before which a new bucket must start (e.g. layer starts).
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be a positive number of elements, got {bucket_size}")
    if any(n < 0 for n in numels):
        raise ValueError("parameter sizes must be non-negative")
    cuts = set(boundaries)
    offsets, buckets = [], []
    pos, start, members, filled = 0, 0, [], 0

    def close():
        nonlocal pos, start, members, filled
        padded = -(-filled // dp_size) * dp_size
        pos = start + padded
        buckets.append(Bucket(len(buckets), start, pos, tuple(members)))
        start, members, filled = pos, [], 0

    for i, n in enumerate(numels):
        if members and (i in cuts or filled >= bucket_size):
            close()
        offsets.append(start + filled)
        members.append(i)
        filled += n
    if members:
        close()
    bucket_index = tuple(b.index for b in buckets for _ in b.params)  # members are consecutive indices
    return FlatLayout(tuple(numels), tuple(offsets), tuple(buckets), dp_size, bucket_index)
