"""The order check (megazero/runtime/order_check.py): planted divergences stop every rank at once, naming
the group, the position and both sides, instead of hanging (gloo) or summing the wrong buffers (NCCL)."""
import time

import pytest
import torch
import torch.distributed as dist

from megazero.runtime import comm
from megazero.runtime.parallel_context import ParallelContext
from megazero.core.topology import Topology
from tests.harness import RankError, run_ranks


def _buckets(skip_rank, tagged):
    """Four equal-size 'bucket' reduce-scatters over dp, then a one-element norm all-reduce; `skip_rank`
    leaves out bucket 1, as a rank without gradients in it used to."""
    pctx = ParallelContext(Topology(dp=4), verify_order=True)
    out = torch.empty(2)
    for i in range(4):
        if dist.get_rank() == skip_rank and i == 1:
            continue
        comm.reduce_scatter(out, torch.ones(8), pctx.dp_group, tag=f"bucket {i}" if tagged else None)
    comm.all_reduce(torch.ones(1, dtype=torch.float64), pctx.dp_group)
    return out.tolist()


def _expect_error(fn, world, *args, within=40.0):
    start = time.monotonic()
    with pytest.raises(RankError) as err:
        run_ranks(fn, world, *args, timeout=90)
    elapsed = time.monotonic() - start
    assert elapsed < within, f"the divergence took {elapsed:.0f}s to stop the ranks"
    return str(err.value)


def test_skipped_bucket_named_at_its_position():
    msg = _expect_error(_buckets, 4, 2, True)
    assert "group dp (ranks [0, 1, 2, 3]) diverges at operation #1" in msg
    assert "reduce_scatter torch.float32 x8 sum [bucket 1]" in msg
    assert "rank 2: reduce_scatter torch.float32 x8 sum [bucket 2]" in msg
    assert "test_order_check.py" in msg  # the call site


def test_skipped_untagged_collective_found_where_the_sequences_part():
    msg = _expect_error(_buckets, 4, 3, False)
    # the skipping rank's norm all-reduce meets the others' last reduce-scatter
    assert "diverges at operation #3" in msg
    assert "rank 3: all_reduce torch.float64 x1 sum" in msg and "reduce_scatter torch.float32 x8" in msg


def test_same_program_passes_and_costs_no_result():
    assert run_ranks(_buckets, 4, -1, True, timeout=90) == [[4.0, 4.0]] * 4


def _boundary(shape_on_rank1):
    pctx = ParallelContext(Topology(pp=2), verify_order=True)
    if dist.get_rank() == 0:
        comm.send(torch.ones(2, 3), 1, pctx.pp_group)
    else:
        comm.recv(torch.empty(shape_on_rank1), 0, pctx.pp_group)
    return True


def test_boundary_of_another_shape_named():
    msg = _expect_error(_boundary, 2, (3, 2))
    assert "p2p 0 -> 1 on group pp diverges at operation #0" in msg
    assert "rank 0: send torch.float32 (2, 3)" in msg and "rank 1: recv torch.float32 (3, 2)" in msg
    assert run_ranks(_boundary, 2, (2, 3), timeout=60) == [True, True]


def _crossed_groups():
    """Rank 0 reduces over the world group then the background group (another communicator of the same
    ranks); rank 1 the other way round: on NCCL and gloo both wait forever. Both ranks end up blocked
    inside a collective, so the watchdog stops them."""
    pctx = ParallelContext(Topology(dp=2), verify_order=True, timeout_s=120)
    pair = [pctx.world_group, pctx.background_group]
    if dist.get_rank() == 1:
        pair.reverse()
    for g in pair:
        comm.all_reduce(torch.ones(4), g)
    return True


def test_crossed_order_across_groups_is_a_deadlock_not_a_hang():
    msg = _expect_error(_crossed_groups, 2, within=45)
    assert "deadlock" in msg and "on world at" in msg and "on background at" in msg
    assert "died with exit code 70" in msg  # blocked in gloo: the watchdog stopped it, saying why


def _off():
    pctx = ParallelContext(Topology(dp=2), verify_order=False)
    return pctx.order is None and pctx.dp_group.order is None


def test_off_when_asked():
    assert run_ranks(_off, 2, timeout=60) == [True, True]


def _pipeline_with_another_boundary():
    """The real executor on 2 stages where stage 1 expects activations of another width (as a stage built
    from another config would): the first boundary's receive meets a send of another shape."""
    from megazero.core.schedules import get_schedule
    from megazero.pipeline.executor import PipelineExecutor
    from megazero.pipeline.p2p import PipeP2P
    from megazero.pipeline.pipeline_module import PipelineModule
    from megazero.zero.optimizer import OptimizerSpec, ZeroOptimizer
    from tests.test_pipeline_exec import HID, MB, SEQ, layers, loss_fn, microbatches

    pctx = ParallelContext(Topology(pp=2), timeout_s=60, verify_order=True)
    model = PipelineModule(layers(4), 2, pctx.pp_rank, loss_fn, "uniform")
    opt = ZeroOptimizer(list(model.parameters()), pctx, stage=0, spec=OptimizerSpec("sgd", lr=0.0))
    width = HID if pctx.pp_rank == 0 else HID + 2
    ex = PipelineExecutor(model, PipeP2P(pctx.pp_group, (MB, SEQ, width), torch.float32), opt, pctx.pp_rank, 2,
                          rank=pctx.global_rank)
    ex.run(get_schedule("1f1b", 2, 4)[pctx.pp_rank], iter(microbatches(4)), 4)
    return True


def test_pipeline_boundary_of_another_shape_stops_both_stages():
    msg = _expect_error(_pipeline_with_another_boundary, 2)
    assert "p2p 0 -> 1 on group pp diverges at operation #0" in msg
    assert f"send torch.float32 (" in msg and "recv torch.float32 (" in msg
    assert "megazero/pipeline/p2p.py" in msg or "executor.py" in msg


def _zero_with_a_skipped_bucket(stage):
    """The real ZeRO optimizer on 2 dp ranks; dp rank 1 skips bucket 1's reduction, as a rank whose bucket got
    no gradient once did: NCCL would pair its bucket 2 with rank 0's bucket 1 (equal sizes, wrong sums)."""
    from megazero.zero.flat_group import FlatGroup
    from megazero.zero.optimizer import OptimizerSpec, ZeroOptimizer
    from tests.test_zero import make_model

    if dist.get_rank() == 1:
        real = FlatGroup.reduce_bucket

        def reduce_bucket(self, b, async_op=False):
            if b == 1:
                self._next += 1  # skipped
                return None
            return real(self, b, async_op)
        FlatGroup.reduce_bucket = reduce_bucket
    pctx = ParallelContext(Topology(dp=2), verify_order=True)
    model = make_model()
    opt = ZeroOptimizer(list(model.parameters()), pctx, stage=stage, spec=OptimizerSpec("sgd", lr=0.1),
                        reduce_bucket_size=128)
    torch.manual_seed(dist.get_rank())
    model(torch.randn(4, 8)).square().mean().backward()
    opt.after_backward()
    opt.step()
    return True


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_rank_skipping_a_bucket_stops_with_both_buckets_named(stage):
    msg = _expect_error(_zero_with_a_skipped_bucket, 2, stage)
    assert "group dp (ranks [0, 1]) diverges at operation #1" in msg, msg
    assert "bucket 1]" in msg and "bucket 2]" in msg and "megazero/zero/flat_group.py" in msg
