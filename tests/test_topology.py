"""Pure tests of the PP x DP x TP grid arithmetic (no processes)."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from megazero.core.topology import KNOWN_AXES, Topology


def test_default_order_puts_tp_innermost():
    t = Topology(pp=2, dp=2, tp=2)
    assert t.order == ("pp", "dp", "tp")
    assert t.axis_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.axis_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.axis_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.model_parallel_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert t.embedding_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.coords(5)._asdict() == {"pp": 1, "dp": 0, "ep": 0, "cp": 0, "tp": 1}
    assert t.rank(pp=1, dp=1, tp=0) == 6


def test_other_axis_order_is_honoured():
    t = Topology(pp=2, dp=2, tp=2, order=("tp", "pp", "dp"))
    assert t.axis_groups("dp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.axis_groups("tp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.axis_groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_embedding_groups_and_pipeline_peers():
    t = Topology(pp=4, dp=1, tp=2)
    assert t.embedding_groups() == [[0, 6], [1, 7]]
    assert t.pipeline_peers(0) == (None, 2)
    assert t.pipeline_peers(3) == (1, 5)
    assert t.pipeline_peers(7) == (5, None)
    assert t.pipeline_peers(7, wrap=True) == (5, 1)
    assert Topology(pp=1, dp=2, tp=1).embedding_groups() == [[0], [1]]


def test_extra_axes_keep_room_for_ep_and_cp():
    t = Topology(pp=2, dp=2, cp=2, tp=2)
    assert t.order == ("pp", "dp", "cp", "tp")
    assert t.axis_groups("cp")[0] == [0, 2]
    assert t.world_size == 16


@pytest.mark.parametrize("kwargs, needle", [
    (dict(pp=0), "pp=0"), (dict(tp=-1), "tp=-1"), (dict(dp=1.5), "dp=1.5"), (dict(xp=2), "'xp'"),
    (dict(pp=2, dp=2, order=("pp", "tp")), "'dp'"), (dict(order=("pp", "pp", "tp")), "repeats"),
    (dict(order=("pp", "dp", "zz")), "'zz'"),
])
def test_bad_topologies_name_the_argument(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        Topology(**kwargs)


def test_out_of_range_rank_and_coordinate():
    t = Topology(pp=2, dp=1, tp=2)
    with pytest.raises(ValueError, match="rank 4"):
        t.coords(4)
    with pytest.raises(ValueError, match="tp=2"):
        t.rank(tp=2)


def _sizes():
    """Grids up to 16384 ranks over pp, dp, (cp), tp with a random axis order."""
    pow2 = st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128])
    anysize = st.integers(1, 12)
    return st.tuples(st.one_of(pow2, anysize), st.one_of(pow2, anysize), st.one_of(pow2, anysize),
                     st.sampled_from([1, 1, 2]), st.permutations(["pp", "dp", "cp", "tp"])).filter(
        lambda s: s[0] * s[1] * s[2] * s[3] <= 16384)


@settings(max_examples=60, deadline=None)
@given(_sizes())
def test_grid_properties(sizes):
    pp, dp, tp, cp, order = sizes
    t = Topology(pp=pp, dp=dp, tp=tp, cp=cp, order=order)
    n = pp * dp * tp * cp
    assert t.world_size == n
    # rank <-> coords is a bijection (checked on a sample of ranks for big grids)
    step = max(1, n // 257)
    for r in range(0, n, step):
        c = t.coords(r)
        assert t.rank(**{a: getattr(c, a) for a in t.order}) == r
    for axis in ("pp", "dp", "tp", "cp"):
        groups = t.axis_groups(axis)
        assert len(groups) == n // t.size(axis)
        assert all(len(g) == t.size(axis) for g in groups)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(n))  # a partition of the world
        for g in groups[:: max(1, len(groups) // 17)]:
            cs = [t.coords(r) for r in g]
            for other in KNOWN_AXES:
                if other != axis:
                    assert len({getattr(c, other) for c in cs}) == 1
            assert sorted(getattr(c, axis) for c in cs) == list(range(t.size(axis)))
            assert t.group_of(g[0], axis) == g
    if order[-1] == "tp":
        assert all(g == list(range(g[0], g[0] + tp)) for g in t.axis_groups("tp"))
    mp = t.model_parallel_groups()
    assert len(mp) == dp and all(len(g) == n // dp for g in mp)
    emb = t.embedding_groups()
    assert len(emb) == n // pp and all(len(g) == min(pp, 2) for g in emb)
    assert math.prod(t.size(a) for a in t.order) == n


def test_any_axis_names_lay_out_row_major():
    """DeepSpeed's ProcessTopology(["x", "y", "z"], [2, 3, 4]) is a Topology of those names: the last axis
    varies fastest, and every query answers for the names given."""
    t = Topology.of(["x", "y", "z"], [2, 3, 4])
    assert t.order == ("x", "y", "z") and t.world_size == 24 and t.size("y") == 3
    assert t.position(5) == {"x": 0, "y": 1, "z": 1}
    assert t.rank(x=1, y=2, z=3) == 23
    assert t.axis_groups("y")[:2] == [[0, 4, 8], [1, 5, 9]]
    assert t.matching(y=1) == [4, 5, 6, 7, 16, 17, 18, 19] and t.matching(x=1, y=0, z=2) == [14]
    assert t.matching() == list(range(24))
    assert Topology(order=("x", "tp"), x=2, tp=2) == Topology.of(["x", "tp"], [2, 2])
    with pytest.raises(ValueError, match="position"):
        t.coords(0)  # Coord has the known axes only
    with pytest.raises(ValueError, match="'w'"):
        t.size("w")
    with pytest.raises(ValueError, match="one size per axis"):
        Topology.of(["x", "y"], [2])
    ds = Topology.of(["pipe", "data", "model"], [2, 3, 2])
    assert ds.renamed({"pipe": "pp", "data": "dp", "model": "tp"}) == Topology(pp=2, dp=3, tp=2)
