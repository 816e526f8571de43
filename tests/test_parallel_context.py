"""8-rank gloo tests: group membership checked with real collectives, and exact comm byte counts."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from megazero.runtime import comm
from megazero.runtime.parallel_context import ParallelContext
from megazero.core.topology import Topology
from tests.harness import RankError, run_ranks


def _members(group):
    """The global ranks of `group`, found by all-gathering each member's rank."""
    out = torch.zeros(group.size, dtype=torch.int64)
    comm.all_gather(out, torch.tensor([dist.get_rank()]), group)
    return out.tolist()


def _check_groups(order):
    topo = Topology(pp=2, dp=2, tp=2, order=order)
    pctx = ParallelContext(topo)
    r = dist.get_rank()
    got = {name: _members(getattr(pctx, f"{name}_group")) for name in ("tp", "dp", "pp", "world")}
    got["embedding"] = _members(pctx.embedding_group)
    expect = {"tp": topo.group_of(r, "tp"), "dp": topo.group_of(r, "dp"), "pp": topo.group_of(r, "pp"),
              "world": list(range(8)),
              "embedding": topo.group_of(r, "pp")}
    return got, expect, (pctx.tp_rank, pctx.dp_rank, pctx.pp_rank), tuple(pctx.coords[:1]) + (pctx.coords.dp, pctx.coords.tp)


@pytest.mark.parametrize("order", [("pp", "dp", "tp"), ("tp", "pp", "dp")])
def test_groups_match_topology_with_real_collectives(order):
    for got, expect, ranks, coords in run_ranks(_check_groups, 8, order, timeout=90):
        assert got == expect
        assert ranks == (coords[2], coords[1], coords[0])


def _count_bytes():
    pctx = ParallelContext(Topology(pp=2, dp=2, tp=2))
    n = 12  # elements per tensor, divisible by every group size
    x = torch.full((n,), float(dist.get_rank()))
    comm.all_reduce(x, pctx.dp_group)  # 2*(2-1)/2 * 12 = 12 elements
    shard = torch.empty(n // 2)
    comm.reduce_scatter(shard, torch.ones(n), pctx.tp_group)  # (2-1) * 6 = 6 elements
    full = torch.empty(n * 8)
    comm.all_gather(full, torch.ones(n), pctx.world_group)  # (8-1) * 12 = 84 elements
    comm.all_reduce(torch.ones(3, dtype=torch.float64), pctx.world_group)  # 2*7/8*3 = 5.25 elements
    s = pctx.stats
    return (s.total("dp", "all_reduce"), s.total("tp", "reduce_scatter"), s.total("world", "all_gather"),
            s.total("world", "all_reduce"), x.tolist(), shard.tolist(), s.snapshot())


def test_comm_stats_count_exact_bytes():
    for rank, res in enumerate(run_ranks(_count_bytes, 8, timeout=90)):
        ar, rs, ag, ar64, x, shard, snap = res
        assert (ar.calls, ar.elements, ar.bytes) == (1, 12, 48)
        assert (rs.calls, rs.elements, rs.bytes) == (1, 6, 24)
        assert (ag.calls, ag.elements, ag.bytes) == (1, 84, 336)
        assert (ar64.calls, ar64.elements, ar64.bytes) == (1, 5.25, 42)
        dp_peer = rank ^ 2  # dp groups are [0,2],[1,3],...
        assert x == [float(rank + dp_peer)] * 12
        assert shard == [2.0] * 6
        assert snap["dp/all_reduce"]["bytes"] == 48


def _two_contexts():
    a = ParallelContext(Topology(pp=1, dp=2, tp=2))
    b = ParallelContext(Topology(pp=1, dp=2, tp=2, order=("tp", "dp")))  # tp groups are [0,2],[1,3]
    r = dist.get_rank()
    xa, xb = torch.tensor([float(r)]), torch.tensor([float(10 * r)])
    wa = comm.all_reduce(xa, a.tp_group, async_op=True)
    comm.all_reduce(xb, b.tp_group)
    wa.wait()
    comm.broadcast(t := torch.tensor([float(r)]), 0, b.dp_group)
    comm.send(torch.tensor([r * 1.0]), 1 - a.dp_rank, a.dp_group) if a.dp_rank == 0 else None
    got = torch.zeros(1)
    if a.dp_rank == 1:
        comm.recv(got, 0, a.dp_group)
    return xa.item(), xb.item(), t.item(), got.item(), a.stats.total().calls, b.stats.total().calls


def test_two_contexts_do_not_interfere():
    res = run_ranks(_two_contexts, 4, timeout=90)
    assert [r[0] for r in res] == [1, 1, 5, 5]
    assert [r[1] for r in res] == [20, 40, 20, 40]
    assert [r[2] for r in res] == [0, 0, 2, 2]  # b's dp groups are [0,1],[2,3] with src = first member
    assert [r[3] for r in res] == [0, 0, 0, 1]  # a's dp groups are [0,2],[1,3]: rank 2 got 0, 3 got 1
    assert [r[4] for r in res] == [2, 2, 2, 2] and [r[5] for r in res] == [2, 2, 2, 2]


def _wrong_world():
    ParallelContext(Topology(pp=2, dp=1, tp=2))


def test_context_rejects_a_layout_that_does_not_fit_the_world():
    with pytest.raises(RankError, match="needs 4 ranks, but the world size is 2"):
        run_ranks(_wrong_world, 2, timeout=60)


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise KeyError("boom on one")
    dist.barrier()  # rank 0 waits for a rank that will never come


def _sleep_forever():
    time.sleep(3600)


def _thread_count():
    return torch.get_num_threads(), os.environ["WORLD_SIZE"]


def test_harness_reports_rank_and_traceback_and_never_hangs():
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 of 2 failed.*KeyError: 'boom on one'(.|\n)*_raise_on_rank_one"):
        run_ranks(_raise_on_rank_one, 2, timeout=60)
    with pytest.raises(RankError, match=r"timeout after 3s: ranks \[0, 1\] of 2 did not finish"):
        run_ranks(_sleep_forever, 2, timeout=3)
    assert time.monotonic() - t0 < 30
    cores = os.cpu_count()
    assert run_ranks(_thread_count, 4, timeout=60) == [(max(1, cores // 4), "4")] * 4


def _created_groups():
    created = []
    real = dist.new_group

    def spy(ranks=None, *args, **kwargs):
        created.append((tuple(ranks), kwargs.get("backend")))
        return real(ranks, *args, **kwargs)

    dist.new_group = spy
    try:
        pctx = ParallelContext(Topology(pp=2, dp=2, tp=2))
        before = list(created)
        pctx.background_group  # the first asynchronous save
        pctx.background_group
        return before, created[len(before):], pctx.world_group.pg is dist.group.WORLD
    finally:
        dist.new_group = real


def test_only_the_groups_megazero_uses_are_created():
    """Every new_group is a communicator NCCL may build (hundreds of MB each): no model-parallel group
    (nothing used it), no second world group (the default group serves), and the gloo background group
    only when an asynchronous save first needs it, once."""
    topo = Topology(pp=2, dp=2, tp=2)
    for before, later, world_is_default in run_ranks(_created_groups, 8, timeout=60):
        made = {ranks for ranks, _ in before}
        assert not made & {tuple(g) for g in topo.model_parallel_groups()}
        assert tuple(range(8)) not in made and world_is_default
        assert later == [(tuple(range(8)), "gloo")]
