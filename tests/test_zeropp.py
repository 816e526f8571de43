"""ZeRO++ at stage 3 (megazero/zero/zeropp.py) on 8 gloo ranks emulating 2 nodes x 4: hpZ trains
bit for bit as plain ZeRO-3 with its backward gathers inside the node and its secondary partition in the
memory breakdown; qwZ and qgZ move the bytes their formulas say, within error bounds derived from int8
block quantization (max|block| / 254 per element and rank)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megazero.core.topology import Topology
from megazero.runtime import comm
from megazero.runtime.comm import CommStats
from megazero.runtime.parallel_context import ParallelContext
from megazero.zero.zeropp import BLOCK, dequantize, quantize, quantized_all_gather, quantized_reduce_scatter
from tests.harness import run_ranks

K = 4  # ranks per emulated node


def test_int8_blocks_are_within_half_a_step():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 1000)
    q, scales = quantize(x)
    assert q.dtype == torch.int8 and q.numel() == 1024 and scales.numel() == 4
    err = (dequantize(q, scales, 1000) - x).abs()
    bound = torch.repeat_interleave(scales / 2, BLOCK)[:1000]
    assert bool((err <= bound * (1 + 1e-6)).all())
    assert torch.equal(dequantize(*quantize(torch.zeros(300)), 300), torch.zeros(300))


def _collectives(shard: int):
    stats = CommStats()
    pctx = ParallelContext(Topology(dp=8), stats=stats)
    g, rank = pctx.dp_group, dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(shard, generator=gen) * (1 + rank)
    got = torch.empty(8 * shard)
    quantized_all_gather(got, x, g, async_op=True).wait()
    exact = torch.empty(8 * shard)
    comm.all_gather(exact, x, g)
    grads = torch.randn(8 * shard, generator=gen)
    mine, want = torch.empty(shard), torch.empty(shard)
    before = stats.total(axis="dp", op="all_to_all").bytes
    quantized_reduce_scatter(mine, grads, g)
    a2a = stats.total(axis="dp", op="all_to_all").bytes - before
    comm.reduce_scatter(want, grads.clone(), g)
    # the bound of the reduce-scatter: every rank's quantization error of my chunk, max|block| / 254 each
    chunks = torch.cat([grads.view(8, shard), torch.zeros(8, (-shard) % BLOCK)], 1)
    _, scales = quantize(chunks)
    table = torch.zeros(8, 8, scales.numel() // 8)  # (rank r, chunk j, block): r's scales of chunk j
    table[rank] = scales.view(8, -1)
    comm.all_reduce(table, pctx.world_group)
    rs_bound = torch.repeat_interleave(table[:, rank].sum(0) / 2, BLOCK)[:shard]  # every rank's error of my chunk
    return (got - exact).abs().numpy(), exact.numpy(), (mine - want).abs().numpy(), rs_bound.numpy(), a2a


@pytest.mark.parametrize("shard", [512, 700])
def test_quantized_collectives_are_within_their_bounds_and_move_int8(shard):
    for rank, (ag_err, exact, rs_err, rs_bound, a2a) in enumerate(run_ranks(_collectives, 8, shard, timeout=120)):
        for r in range(8):  # every rank's gathered shard: within max|its block| / 254
            part = torch.as_tensor(exact[r * shard:(r + 1) * shard])
            _, scales = quantize(part)
            bound = torch.repeat_interleave(scales / 2, BLOCK)[:shard]
            assert bool((torch.as_tensor(ag_err[r * shard:(r + 1) * shard]) <= bound * (1 + 1e-5)).all())
        assert bool((torch.as_tensor(rs_err) <= torch.as_tensor(rs_bound) * (1 + 1e-5) + 1e-6).all())
        padded = shard + (-shard) % BLOCK
        assert a2a == 7 * (padded + 4 * padded // BLOCK)  # int8 chunks and their scales to the 7 others


BASE = {"model": {"spec": "model_specs/gpt.py:debug"},
        "train": {"micro_batch_size": 1, "global_batch_size": 16, "seed": 5},
        "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.1},
        "zero": {"stage": 3, "reduce_bucket_size": 20000, "param_persistence_threshold": 0},
        "parallel": {"ranks_per_node": K}}


def _train(cfg: dict, steps: int = 3):
    """Losses, norms, rank 0's final parameters, this rank's bytes by (axis, op) (all and inter-node),
    the bytes the ZeRO-3 groups hold in `params` when the step starts, and each bucket's gathers and
    reductions with their shard sizes."""
    import megazero
    from tests.parity import steps_and_params

    engine, optimizer, data, _ = megazero.initialize(config=cfg)
    calls = {"gather": {}, "reduce": {}}
    for gi, group in enumerate(optimizer.groups):
        def counted(fn, kind, gi=gi):
            def wrapped(b, *a, **k):
                key = kind + ("_exact" if k.get("exact") else "")  # views gather exactly (full_parameters)
                calls.setdefault(key, {})[(gi, b)] = calls.setdefault(key, {}).get((gi, b), 0) + 1
                return fn(b, *a, **k)
            return wrapped
        group.gather_bucket = counted(group.gather_bucket, "gather")
        reduce = group.reduce_bucket

        def reduce_counted(b, *a, gi=gi, reduce=reduce, **k):  # every bucket's reduction communicates
            calls["reduce"][(gi, b)] = calls["reduce"].get((gi, b), 0) + 1
            return reduce(b, *a, **k)
        group.reduce_bucket = reduce_counted
    # ‖ΔW‖ of qwZ's first gathers: the int8 error of the initial weight shards, over every rank
    sq = torch.zeros(1, dtype=torch.float64)
    for group in optimizer.groups:
        if group.shard_params:
            for shard in group.param_owned:
                sq += float((dequantize(*quantize(shard), shard.numel()) - shard.float()).square().sum())
    comm.all_reduce(sq, engine.pctx.world_group)
    held = []
    step = optimizer.step
    optimizer.step = lambda: (held.append(optimizer.memory_breakdown()["params"]), step())[1]
    losses, norms, params = steps_and_params(engine, optimizer, data, steps)
    counts = engine.pctx.stats.counts
    moved = {f"{a}/{o}": c.bytes for (a, o), c in counts.items()}
    crossed = {f"{a}/{o}": c.bytes for (a, o), c in engine.pctx.stats.inter_node.items()}
    shards = {(gi, b): bk.numel // group.dp.size for gi, group in enumerate(optimizer.groups)
              for b, bk in enumerate(group.layout.buckets)}
    sharded = sum(bk.numel for group in optimizer.groups if group.shard_params for bk in group.layout.buckets)
    return (losses, norms, params if dist.get_rank() == 0 else {}, moved, crossed, held, calls, shards, sharded,
            float(sq.sqrt()))


def _zero(**options):
    return dict(BASE, zero=dict(BASE["zero"], **options))


@pytest.fixture(scope="module")
def plain():
    return run_ranks(_train, 8, _zero(), timeout=300)


def test_hpz_trains_exactly_with_backward_gathers_inside_the_node(plain):
    """hpz_partition_size = 4 (a node): the same losses, norms and parameters bit for bit; the dp
    all-gathers (the first of each bucket per step) plus the hpz ones inside the node; no hpz byte
    crosses a node; the ZeRO-3 groups hold their 1/4 secondary parts (P/4 fp32 per bucket) at the step."""
    hpz = run_ranks(_train, 8, _zero(hpz_partition_size=K), timeout=300)
    assert hpz[0][0] == plain[0][0] and hpz[0][1] == plain[0][1]
    assert all((hpz[0][2][k] == v).all() for k, v in plain[0][2].items())
    for r in range(8):
        moved, crossed = hpz[r][3], hpz[r][4]
        assert moved["hpz/all_gather"] > 0 and crossed.get("hpz/all_gather", 0) == 0
        assert moved["dp/all_gather"] < plain[r][3]["dp/all_gather"]
        secondary = hpz[r][8] // K * 4  # every sharded bucket's part, fp32
        assert hpz[r][5][0] == plain[r][5][0] + secondary
    crossing = {name: sum(run[r][4].get(f"{axis}/all_gather", 0) for r in range(8) for axis in ("dp", "hpz"))
                for name, run in (("plain", plain), ("hpz", hpz))}
    over_dp = {name: sum(run[r][3]["dp/all_gather"] for r in range(8)) for name, run in (("plain", plain), ("hpz", hpz))}
    # only each bucket's first gather of a step goes over dp, crossing nodes as plain's gathers do
    assert crossing["hpz"] == pytest.approx(crossing["plain"] * over_dp["hpz"] / over_dp["plain"], rel=1e-9)
    for r in range(8):  # once per bucket and step, (n-1)·4·S bytes: 3 steps and the final full_parameters()
        buckets = plain[r][6]["gather"]
        assert hpz[r][3]["dp/all_gather"] == (3 + 1) * sum(7 * 4 * plain[r][7][k] for k in buckets)


def test_qwz_moves_int8_weights_and_stays_within_the_derived_error(plain):
    """quantized_weights: each gather moves (n-1)·(S' + 4·S'/256) bytes for S-element shards (S'
    padded to whole blocks) instead of (n-1)·4S; the first loss differs from exact ZeRO-3 by at most
    twice the first-order bound ‖g‖·‖ΔW‖ with ‖ΔW‖ ≤ ‖max|block|/254‖ over the weights."""
    q = run_ranks(_train, 8, _zero(quantized_weights=True), timeout=300)
    for r in range(8):
        calls, shards = q[r][6]["gather"], q[r][7]
        exact = sum(c * 7 * 4 * shards[k] for k, c in q[r][6].get("gather_exact", {}).items())  # full_parameters()
        expect = sum(c * 7 * (-(-shards[k] // BLOCK) * BLOCK * 1 + 4 * -(-shards[k] // BLOCK)) for k, c in calls.items())
        plain_expect = sum(c * 7 * 4 * shards[k] for k, c in plain[r][6]["gather"].items())
        plain_expect += sum(c * 7 * 4 * shards[k] for k, c in plain[r][6].get("gather_exact", {}).items())
        expect, plain_int8 = expect + exact, expect
        assert q[r][3]["dp/all_gather"] == expect and plain[r][3]["dp/all_gather"] == plain_expect
        assert (plain_expect - exact) / plain_int8 > 3.8  # the training gathers: int8 against fp32
    dw = q[0][9]  # ‖ΔW‖ of the first gathers: the int8 error of the initial weights, measured
    assert 0 < abs(q[0][0][0] - plain[0][0][0]) <= 2 * plain[0][1][0] * dw
    assert abs(q[0][0][-1] - plain[0][0][-1]) <= 0.01 * plain[0][0][-1]


def test_qgz_moves_int8_gradients(plain):
    """quantized_gradients: each bucket's reduce-scatter moves (n-1)·(S' + 4·S'/256) bytes by all-to-all
    instead of (n-1)·4S; the first loss is exact (no update yet) and the run stays within 1%."""
    q = run_ranks(_train, 8, _zero(quantized_gradients=True), timeout=300)
    assert q[0][0][0] == plain[0][0][0]
    assert abs(q[0][0][-1] - plain[0][0][-1]) <= 0.01 * plain[0][0][-1]
    for r in range(8):
        calls, shards = q[r][6]["reduce"], q[r][7]
        sharded = {k for k in calls if k in shards}
        expect = sum(calls[k] * 7 * (-(-shards[k] // BLOCK) * BLOCK + 4 * -(-shards[k] // BLOCK)) for k in sharded)
        assert q[r][3]["dp/all_to_all"] == expect
        assert "dp/reduce_scatter" not in q[r][3] or q[r][3]["dp/reduce_scatter"] < plain[r][3]["dp/reduce_scatter"]


@pytest.mark.parametrize("overrides,words", [
    (["zero.stage=2", "zero.quantized_weights=true"], "zero.quantized_weights: ZeRO++ needs zero.stage=3"),
    (["zero.stage=1", "zero.hpz_partition_size=4"], "zero.hpz_partition_size: ZeRO++ needs zero.stage=3"),
    (["zero.stage=3", "zero.hpz_partition_size=3"], "zero.hpz_partition_size=3 does not divide the data-parallel"),
    (["parallel.ranks_per_node=3"], "parallel.ranks_per_node=3 does not divide the world size 8"),
])
def test_bad_zeropp_and_node_settings_are_refused_before_any_process_group(overrides, words):
    from megazero.core.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config({"model": {"spec": "model_specs/gpt.py:debug"}}, overrides, world_size=8)
    assert words in str(info.value), str(info.value)


def test_deepspeeds_zeropp_keys_map():
    from megazero.core.config import from_deepspeed

    z = from_deepspeed({"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 8,
                                              "zero_quantized_gradients": True}}).zero
    assert (z.quantized_weights, z.hpz_partition_size, z.quantized_gradients) == (True, 8, True)


def test_an_hpz_group_that_spans_nodes_is_refused_before_any_process_group():
    """tp 2 on nodes of 4 ranks: only 2 dp ranks share a node, so an hpZ group of 4 would span two."""
    from megazero.core.config import ConfigError
    from megazero.engine import load_run_config

    with pytest.raises(ConfigError, match="zero.hpz_partition_size=4: its groups span nodes of 4 ranks .dp ranks are "
                                          "2 ranks apart.; use at most 2"):
        load_run_config(_zero(hpz_partition_size=4), ["parallel.tp=2"], world_size=8)


def _gathered_under_qwz(modify: bool):
    """qwZ: full_parameters / GatheredParameters see (and write back) the exact weights, not int8 ones."""
    import megazero
    from megazero.zero import GatheredParameters

    engine, optimizer, data, _ = megazero.initialize(config=_zero(quantized_weights=True))
    engine.train_batch(data)
    masters = [m.clone() for group in optimizer.groups for m in group.master]
    p = next(iter(engine.module.parameters()))
    with GatheredParameters([p], modifier_rank=0 if modify else None):
        pass  # nothing written: every master must stay as it was, bit for bit
    return all(torch.equal(a, m) for a, m in zip(masters, (m for group in optimizer.groups for m in group.master), strict=True))


def test_views_under_qwz_write_back_the_exact_weights():
    assert all(run_ranks(_gathered_under_qwz, 8, True, timeout=300))
