"""compat/ answers DeepSpeed's queries from megazero's own parts (no copies): DeepSpeed's topology and grid
from `core/topology.py:Topology`, its RNG tracker from `tensor_parallel/random.py:RNGStatesTracker`, its
activation `checkpoint` on `activation_checkpoint/`'s checkpointer, its comms logger from `runtime/comm.py:CommStats`
(of `megazero.comm`'s calls and of the live engines in `compat/engines.py`'s registry). One process, no groups."""
import gc
import types

import pytest
import torch

from megazero.activation_checkpoint import ActivationCheckpointer
from megazero.compat import activation_api, dist_api
from megazero.compat.engines import Registry
from megazero.compat.pipe_topology import PipeModelDataParallelTopology, ProcessTopology, as_megazero, of_megazero
from megazero.core.topology import Topology
from megazero.runtime.comm import CommStats
from megazero.tensor_parallel.random import RNGStatesTracker


@pytest.mark.parametrize("make", [lambda: ProcessTopology(["x", "y", "z"], [2, 3, 4]),
                                  lambda: PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=3)])
def test_a_process_topology_is_a_view_of_a_topology(make):
    view = make()
    assert set(vars(view)) == {"topology", "axes", "dims", "ProcessCoord"}  # no mapping of its own
    t = view.topology
    assert isinstance(t, Topology) and list(t.order) == view.axes
    for rank in range(t.world_size):
        assert view.get_coord(rank)._asdict() == t.position(rank)
        assert view.get_rank(**t.position(rank)) == t.rank(**t.position(rank)) == rank
    for axis in view.axes:
        assert view.get_axis_comm_lists(axis) == t.axis_groups(axis)
        assert view.get_axis_list(axis, 1) == t.matching(**{axis: 1})
    assert view.mapping == {view.get_coord(r): r for r in range(t.world_size)}


def test_the_megazero_and_deepspeed_topologies_are_one_grid():
    ds = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=3)
    ours = as_megazero(ds)
    assert ours == ds.topology.renamed({"pipe": "pp", "data": "dp", "model": "tp"})
    back = of_megazero(ours)
    assert back.axes == ds.axes and back.topology == ds.topology


def test_the_rng_tracker_is_a_view_of_megazeros_streams():
    tracker = activation_api.CudaRNGStatesTracker()
    assert set(vars(tracker)) == {"streams"} and isinstance(tracker.streams, RNGStatesTracker)
    tracker.add("s", 1234)
    assert tracker.streams.seeds == {"s": 1234}
    before = torch.get_rng_state()
    with tracker.fork("s"):
        drawn = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # the global generator is put back
    assert torch.equal(drawn, torch.rand(4, generator=torch.Generator().manual_seed(1234)))
    assert torch.equal(tracker.get_states()["s"], tracker.streams.generator("s", "cpu").get_state())
    tracker.reset()
    assert tracker.streams.seeds == {}


def test_deepspeeds_checkpoint_runs_on_megazeros_checkpointer():
    """Tensor, keyword and plain arguments, a mask and indices that need no gradient: the same outputs and
    gradients as without checkpointing, with dropout from both generators replayed."""
    s = activation_api.CheckpointingState()
    assert isinstance(s.checkpointer, ActivationCheckpointer)
    activation_api.configure(None, checkpoint_in_cpu=True)
    lin = torch.nn.Linear(8, 8)

    def f(x, idx, scale, mask=None):
        with activation_api.get_cuda_rng_tracker().fork():
            h = torch.nn.functional.dropout(lin(x), 0.3)
        h = h[:, idx] * scale * mask
        return h, torch.nn.functional.dropout(h, 0.3).sum()

    x, idx, mask = torch.randn(4, 8, requires_grad=True), torch.tensor([0, 2, 5]), torch.rand(4, 3)
    got = []
    for use in (True, False):
        activation_api.model_parallel_cuda_manual_seed(3)
        checkpoints = activation_api.state().checkpointer.stats.checkpoints
        out = activation_api.checkpoint(f, x, idx, 2.0, mask=mask) if use else f(x, idx, 2.0, mask=mask)
        assert activation_api.state().checkpointer.stats.checkpoints == checkpoints + use
        (out[0].square().sum() + out[1]).backward()
        got.append((*[o.detach() for o in out], x.grad.clone(), lin.weight.grad.clone(), torch.rand(1)))
        x.grad, lin.weight.grad, lin.bias.grad = None, None, None
    assert activation_api.state().checkpointer.stats.recomputes >= 1
    assert len(got[0]) == len(got[1]) == 5
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)
    activation_api.configure(None)


def test_the_comms_logger_reads_comm_stats_of_the_calls_and_the_live_engines():
    reg = Registry()
    log = dist_api.CommsLogger(reg)
    assert set(vars(log)) == {"registry"}  # it keeps nothing
    log.enabled = True
    assert reg.comms.enabled and log.enabled and set(vars(log)) == {"registry"}
    log.append("all_reduce", 4000, 2.0)
    log.append("all_reduce", 4000, 4.0)
    assert reg.comm_stats.timings() == {(dist_api.AXIS, "all_reduce", 4000): (2, 0.006)}
    engine_stats = CommStats()
    engine_stats.record("dp", "all_reduce", 10.0, 4)

    class Engine:  # what the logger reads of an engine: its CommStats and whether its config turned the logger on
        pctx = types.SimpleNamespace(stats=engine_stats)
        config = types.SimpleNamespace(log=types.SimpleNamespace(comms_logger=types.SimpleNamespace(enabled=True)))

    on = Engine()
    reg.add(on)
    row = dist_api.summary(log, world_size=2)
    assert row["summary"]["all_reduce"][4000]["count"] == 2
    assert row["summary"]["all_reduce"][4000]["total_latency_ms"] == pytest.approx(6.0)  # 2 + 4 ms, summed as floats
    assert row["engine"] == {"dp/all_reduce": {"calls": 1, "bytes": 40.0, "inter_node_bytes": 0.0}}
    del on
    gc.collect()
    assert reg.engines() == [] and dist_api.summary(log, world_size=2)["engine"] == {}  # a weak reference
