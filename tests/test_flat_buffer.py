"""Pure tests of ZeRO's flat-buffer and shard index math."""
import pytest
from hypothesis import given, settings, strategies as st

from megazero.core.flat_buffer import build_layout


def test_small_layout_by_hand():
    lay = build_layout([5, 3, 10, 1], dp_size=2, bucket_size=8)
    # a bucket closes once full: [0,1] (8 elements), [2] (10), [3] (1 -> padded to 2)
    assert [(b.start, b.end, b.params) for b in lay.buckets] == [(0, 8, (0, 1)), (8, 18, (2,)), (18, 20, (3,))]
    assert lay.offsets == (0, 5, 8, 18)
    assert lay.shard_ranges(1) == [(4, 8), (13, 18), (19, 20)]
    assert lay.shard_numel == 10 and lay.padding == 1
    segs = lay.segments(lay.buckets[0], 1)
    assert [(s.param, s.buf_start, s.buf_end, s.param_start) for s in segs] == [(0, 4, 5, 4), (1, 5, 8, 0)]
    assert lay.segments(lay.buckets[2], 1) == []  # rank 1 owns only padding there


def test_boundaries_force_new_buckets():
    lay = build_layout([4, 4, 4], dp_size=4, bucket_size=100, boundaries=[1, 2])
    assert [b.params for b in lay.buckets] == [(0,), (1,), (2,)]


@pytest.mark.parametrize("kwargs, needle", [(dict(dp_size=0), "dp_size"), (dict(bucket_size=0), "bucket_size")])
def test_bad_arguments(kwargs, needle):
    args = dict(numels=[3], dp_size=2, bucket_size=4) | kwargs
    with pytest.raises(ValueError, match=needle):
        build_layout(**args)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=40), st.integers(1, 16), st.integers(1, 500),
       st.sets(st.integers(0, 39)))
def test_layout_properties(numels, dp, bucket_size, cuts):
    lay = build_layout(numels, dp, bucket_size, sorted(cuts))
    # buckets tile the buffer, each a multiple of dp; params never straddle buckets
    assert lay.buckets[0].start == 0
    for a, b in zip(lay.buckets[:-1], lay.buckets[1:], strict=True):
        assert a.end == b.start
    assert all(b.numel % dp == 0 for b in lay.buckets)
    assert lay.total % dp == 0 and lay.total >= sum(numels)
    for b in lay.buckets:
        for i in b.params:
            s, e = lay.param_range(i)
            assert b.start <= s and e <= b.end
            assert lay.bucket_of(i) == b.index
    # params do not overlap
    spans = sorted(lay.param_range(i) for i in range(len(numels)))
    for (s1, e1), (s2, e2) in zip(spans[:-1], spans[1:], strict=True):
        assert e1 <= s2
    # shards: equal size, disjoint, together cover every parameter element exactly once
    covered = [0] * len(numels)
    for r in range(dp):
        assert sum(e - s for s, e in lay.shard_ranges(r)) == lay.shard_numel
        for b in lay.buckets:
            for seg in lay.segments(b, r):
                assert 0 <= seg.param_start and seg.param_start + seg.numel <= numels[seg.param]
                covered[seg.param] += seg.numel
    assert covered == list(numels)
