"""DeepSpeed's namespaces under megazero, checked name by name against DeepSpeed 0.19.8 where it runs
here (its pure-Python parts: the topology classes, set_random_seed, log_dist's rule) and against what
DeepSpeed documents elsewhere: `megazero.accelerator`, `megazero.comm` and its comms logger,
`megazero.runtime.pipe.topology` and the engine's `grid`, `megazero.checkpointing`,
`megazero.runtime.utils`, `megazero.utils`. Whole scripts are in tests/test_deepspeed_tutorials.py."""
import itertools
import logging
import random

import pytest
import torch

import megazero
from tests.harness import run_ranks


# -- accelerator ---------------------------------------------------------------------------------------

def test_the_cpu_accelerator_answers_like_deepspeeds():
    from megazero.accelerator import get_accelerator

    acc = get_accelerator()
    assert acc is get_accelerator()  # one per process
    assert (acc.device_name(), acc.device_name(3), acc.current_device_name()) == ("cpu", "cpu", "cpu")
    assert acc.communication_backend_name() == "gloo" and acc.is_available() and acc.is_synchronized_device()
    assert acc.Stream is None and acc.Event is None and acc.current_stream() is None
    with acc.stream(None):
        pass
    acc.synchronize()
    acc.set_device(0)  # a no-op on the host, as DeepSpeed's CPU accelerator
    t = acc.FloatTensor([1, 2])
    assert t.dtype == torch.float32 and acc.on_accelerator(t) and acc.LongTensor([1]).dtype == torch.long
    acc.reset_max_memory_allocated()
    before = acc.max_memory_allocated()
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB touched: the resident set and its peak grow
    assert acc.memory_allocated() > 0 and acc.max_memory_allocated() >= before + 32 * 2**20
    del big
    assert acc.total_memory() > acc.available_memory() > 0
    assert set(acc.supported_dtypes()) == {torch.float, torch.bfloat16, torch.half}
    state = acc.get_rng_state()
    acc.manual_seed(5)
    a = torch.rand(3)
    acc.set_rng_state(state)
    acc.manual_seed(5)
    assert torch.equal(a, torch.rand(3))


def test_both_accelerators_have_every_method_deepspeed_scripts_call():
    """Every public method of DeepSpeed's abstract accelerator that scripts reach exists on both of
    megazero's (the op-builder and graph ones included, refusing or answering as on the CPU)."""
    from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

    from megazero.compat.accelerator import CpuAccelerator, CudaAccelerator

    theirs = {n for n in dir(DeepSpeedAccelerator) if not n.startswith("_")}
    internal = {"register_host_memory", "unregister_host_memory", "pin_memory_alignment", "prefer_triton_grouped_mm",
                "get_compile_backend", "set_compile_backend"}  # DeepSpeed's own pinned-memory pool, compile plumbing
    for cls in (CpuAccelerator, CudaAccelerator):
        missing = sorted(theirs - internal - {n for n in dir(cls)})
        assert missing == [], (cls.__name__, missing)


def test_the_accelerator_is_chosen_as_deepspeed_chooses(monkeypatch):
    from megazero.compat import accelerator as mod

    monkeypatch.setenv("DS_ACCELERATOR", "npu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='npu'.*cuda or cpu"):
        mod.get_accelerator()
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(ValueError, match="no CUDA device"):
        mod.get_accelerator()
    monkeypatch.delenv("DS_ACCELERATOR")
    assert isinstance(mod.get_accelerator(), mod.CpuAccelerator)
    with pytest.raises(NotImplementedError, match="DS_ACCELERATOR"):
        mod.set_accelerator(object())


# -- pipeline topology ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dims", list(itertools.product((1, 2, 3), repeat=3)))
def test_process_topologies_equal_deepspeeds(dims):
    """Every query of ProcessTopology and PipeModelDataParallelTopology answers as DeepSpeed's classes do,
    over a generated set of shapes, and megazero's Topology built from one puts each rank at the same
    coordinates."""
    from deepspeed.runtime.pipe import topology as ds

    from megazero.runtime.pipe import topology as mz
    from megazero.compat.pipe_topology import as_megazero

    pp, mp, dp = dims
    for ours, theirs in ((mz.PipeModelDataParallelTopology(pp, mp, dp), ds.PipeModelDataParallelTopology(pp, mp, dp)),
                         (mz.PipeDataParallelTopology(pp, dp), ds.PipeDataParallelTopology(pp, dp)),
                         (mz.ProcessTopology(["x", "y", "z"], dims), ds.ProcessTopology(["x", "y", "z"], list(dims)))):
        assert ours.world_size() == theirs.world_size() and ours.get_axis_names() == theirs.get_axis_names()
        for axis in ours.axes + ["absent"]:
            assert ours.get_dim(axis) == theirs.get_dim(axis)
            assert ours.get_axis_comm_lists(axis) == theirs.get_axis_comm_lists(axis)
        for rank in range(ours.world_size()):
            assert tuple(ours.get_coord(rank)) == tuple(theirs.get_coord(rank))
            assert ours.get_rank(**ours.get_coord(rank)._asdict()) == rank
            assert ours.get_rank_repr(rank) == theirs.get_rank_repr(rank)
        for axis in ours.axes:
            for idx in range(ours.get_dim(axis)):
                assert ours.get_axis_list(axis, idx) == theirs.get_axis_list(axis, idx)
                assert ours.filter_match(**{axis: idx}) == theirs.filter_match(**{axis: idx})
        if ours.axes[0] == "pipe" and len(ours.axes) == 3:
            t = as_megazero(ours)
            names = {"pipe": "pp", "data": "dp", "model": "tp"}
            for rank in range(ours.world_size()):
                c = ours.get_coord(rank)
                assert all(getattr(t.coords(rank), names[a]) == getattr(c, a) for a in ours.axes)


def test_topology_errors_name_the_problem():
    from megazero.compat.pipe_topology import ProcessTopology, as_megazero

    with pytest.raises(ValueError, match="one size per axis"):
        ProcessTopology(["a", "b"], [2])
    with pytest.raises(ValueError, match="give every axis"):
        ProcessTopology(["a", "b"], [2, 2]).get_rank(a=0)
    with pytest.raises(ValueError, match="axis 'x'"):
        as_megazero(ProcessTopology(["x"], [2]))


def _grid_worker():
    import megazero as deepspeed
    from megazero.pipe import PipelineModule
    from megazero.runtime.pipe.topology import PipeModelDataParallelTopology

    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2)
    net = PipelineModule(layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)], topology=topo,
                         loss_fn=torch.nn.MSELoss())
    engine, *_ = deepspeed.initialize(model=net, config={"train_micro_batch_size_per_gpu": 1,
                                                         "gradient_accumulation_steps": 2})
    g = engine.grid
    return {"stage": g.get_stage_id(), "dp": g.get_data_parallel_rank(), "dp_ranks": g.get_data_parallel_group_ranks(),
            "mp": (g.get_model_parallel_rank(), g.get_model_parallel_world_size()),
            "slice": (g.get_slice_parallel_rank(), g.get_slice_parallel_world_size()),
            "first_last": (g.is_first_stage, g.is_last_stage), "next": g.stage_to_global(1 - g.get_stage_id()),
            "groups": (g.get_pipe_parallel_group() is not None, g.get_data_parallel_group() is not None,
                       g.get_slice_parallel_group() is None), "topology": tuple(g.topology().get_coord(
                           engine.global_rank)), "module_stage": net.stage_index}


def test_the_engine_grid_and_a_pipeline_module_built_from_a_topology():
    """PipelineModule(topology=PipeModelDataParallelTopology(...)) sets the layout (DeepSpeed's way: no
    num_stages, no config pp); the engine's grid answers DeepSpeed's queries for every rank."""
    for rank, got in enumerate(run_ranks(_grid_worker, 4, timeout=120)):
        stage, dp = rank // 2, rank % 2
        assert (got["stage"], got["dp"], got["module_stage"]) == (stage, dp, stage)
        assert got["dp_ranks"] == [2 * stage, 2 * stage + 1] and got["next"] == (rank + 2) % 4
        assert got["mp"] == (stage, 2) and got["slice"] == (0, 1)
        assert got["first_last"] == (stage == 0, stage == 1) and got["groups"] == (True, True, True)
        assert got["topology"] == (stage, dp, 0)


# -- comm and its logger -------------------------------------------------------------------------------

def _comm_worker():
    import megazero.comm as dist

    dist.init_distributed()  # already up (the harness made the group): DeepSpeed's call is then a no-op
    dist.configure(enabled=True, prof_all=True, verbose=False)
    t = torch.ones(1000)
    dist.all_reduce(t)
    dist.all_reduce(t)
    out = torch.empty(2000)
    dist.all_gather_into_tensor(out, torch.ones(1000))
    shard = torch.empty(500)
    dist.reduce_scatter_tensor(shard, torch.ones(1000))
    dist.broadcast(t, 0, prof=True, log_name="weights")
    dist.barrier()
    counts = (dist.get_comm_operation_count(), dist.get_logged_comm_ops(), dist.has_comm_data())
    summary = dist.log_summary(return_dict=True)
    dist.reset_log()
    dist.configure(enabled=False)
    dist.all_reduce(t)
    return {"t": t[0].item(), "counts": counts, "summary": summary["summary"], "after_reset": dist.has_comm_data(),
            "rank": (dist.get_rank(), dist.get_world_size(), dist.get_local_rank(), dist.get_global_rank(None, 1)),
            "ranks": dist.get_all_ranks_from_group(None)}


def test_comm_runs_torch_distributed_and_logs_what_it_ran():
    got = run_ranks(_comm_worker, 2, timeout=120)
    for rank, r in enumerate(got):
        assert r["t"] == 8.0  # 1 -> 2 -> 4, broadcast, then 8 with the logger off
        assert r["counts"] == (6, ["all_gather_into_tensor", "all_reduce", "barrier", "reduce_scatter_tensor",
                                   "weights"], True)
        s = r["summary"]
        assert s["all_reduce"][4000]["count"] == 2 and s["all_gather_into_tensor"][4000]["count"] == 1
        assert s["reduce_scatter_tensor"][4000]["count"] == 1  # DeepSpeed's message: the `tensor` argument and s["weights"][4000]["count"] == 1
        row = s["all_reduce"][4000]  # DeepSpeed's arithmetic: 2 x size / latency, bus = x (n-1)/n
        assert row["busbw_avg_gbps"] == pytest.approx(row["tput_avg_gbps"] / 2)
        assert row["tput_avg_gbps"] == pytest.approx(2 * 4000 * 8 / (row["avg_latency_ms"] / 1e3) / 1e9)
        assert r["after_reset"] is False
        assert r["rank"] == (rank, 2, rank, 1) and r["ranks"] == [0, 1]


def test_comm_configure_errors():
    from megazero.compat import dist_api

    with pytest.raises(ValueError, match="comms_logger.prof_everything: unknown"):
        dist_api.configure({"comms_logger": {"prof_everything": True}})


# -- checkpointing -------------------------------------------------------------------------------------

def test_checkpoint_replays_both_generators_like_no_checkpoint():
    """Dropout from the default generator and from the tracker's stream, checkpointed: the same output and
    gradients as without checkpointing, and the generators end where they would have."""
    import megazero.checkpointing as ckpt

    ckpt.configure(None)
    ckpt.model_parallel_cuda_manual_seed(7)
    lin = torch.nn.Linear(8, 8)

    def f(x):
        with ckpt.get_cuda_rng_tracker().fork():
            x = torch.nn.functional.dropout(lin(x), 0.5)
        return torch.nn.functional.dropout(x, 0.5) * 2

    x = torch.randn(4, 8, requires_grad=True)
    results = []
    for use in (True, False):
        ckpt.model_parallel_cuda_manual_seed(7)
        y = ckpt.checkpoint(f, x) if use else f(x)
        y.square().sum().backward()
        results.append((y.detach().clone(), x.grad.clone(), lin.weight.grad.clone(), torch.rand(2),
                        ckpt.get_cuda_rng_tracker().get_states()["model-parallel-rng"].clone()))
        x.grad, lin.weight.grad, lin.bias.grad = None, None, None
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_checkpointing_configure_follows_deepspeed():
    import megazero.checkpointing as ckpt
    from megazero.compat.activation_api import state

    class Mpu:
        def __init__(self, tp):
            self.tp = tp

        def get_tensor_model_parallel_rank(self):
            return 1

        def get_tensor_model_parallel_world_size(self):
            return self.tp

    ckpt.configure(Mpu(1), deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True,
                                                                          "profile": True}}, profile=False)
    s = state()
    assert ckpt.is_configured() and s.checkpoint_in_cpu and not s.profile and s.tp_size == 1
    ckpt.model_parallel_cuda_manual_seed(10)
    assert torch.initial_seed() == 10  # the default generator: the seed; the stream: seed + 2718 + tp rank
    with pytest.raises(ValueError, match="seed 2729 is already used"):
        ckpt.get_cuda_rng_tracker().add("other", 2729)
    with pytest.raises(NotImplementedError, match="partition_activations=True\\) with 2 tensor-parallel ranks"):
        ckpt.configure(Mpu(2), partition_activations=True)
    with pytest.raises(ValueError, match="needs partition_activations"):
        ckpt.configure(Mpu(1), contiguous_checkpointing=True)
    with pytest.raises(ValueError, match="activation_checkpointing.number_layers: unknown"):
        ckpt.configure(Mpu(1), deepspeed_config={"activation_checkpointing": {"number_layers": 2}})
    ckpt.configure(None)


# -- utils ---------------------------------------------------------------------------------------------

def test_set_random_seed_seeds_what_deepspeeds_seeds():
    import numpy
    from deepspeed.runtime.utils import set_random_seed as theirs

    import megazero as deepspeed

    draws = []
    for seed_fn in (theirs, deepspeed.runtime.utils.set_random_seed):
        seed_fn(1138)
        draws.append((random.random(), numpy.random.rand(), torch.rand(3).tolist()))
    assert draws[0] == draws[1]


def test_see_memory_usage_prints_what_deepspeeds_prints(capsys):
    import megazero as deepspeed

    assert deepspeed.runtime.utils.see_memory_usage("quiet") is None  # without force: nothing
    text = deepspeed.runtime.utils.see_memory_usage("after build", force=True)
    out = capsys.readouterr().out
    assert text in out and out.startswith("after build\nMA ") and "CPU Virtual Memory:  used = " in out


def test_log_dist_logs_on_the_ranks_asked(caplog):
    from megazero.utils import log_dist, logger

    assert logger.name == "megazero"
    with caplog.at_level(logging.INFO, logger="megazero"):
        log_dist("hello", ranks=[0])  # before torch.distributed is up: every process logs (DeepSpeed's rule)
    assert "[Rank -1] hello" in caplog.text


def test_repeating_loader_starts_a_new_shuffled_epoch():
    from megazero.utils import RepeatingLoader

    data = torch.utils.data.TensorDataset(torch.arange(6))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = RepeatingLoader(torch.utils.data.DataLoader(data, batch_size=3, sampler=sampler))
    first = [next(loader)[0].tolist() for _ in range(2)]
    second = [next(loader)[0].tolist() for _ in range(2)]  # the next epoch: set_epoch(1), another order
    assert sorted(sum(first, [])) == sorted(sum(second, [])) == list(range(6)) and first != second
    assert loader.epoch == 1


def test_the_import_paths_exist():
    import megazero as deepspeed

    for path in ("accelerator", "comm", "checkpointing", "runtime.pipe", "runtime.utils", "utils", "pipe", "zero",
                 "ops", "moe", "monitor", "profiling.flops_profiler", "runtime.zero.stage3", "utils.zero_to_fp32",
                 "runtime.pipe.topology"):
        obj = deepspeed
        for part in path.split("."):
            obj = getattr(obj, part)
    from megazero.runtime.pipe.topology import PipeModelDataParallelTopology  # noqa: F401
    from megazero.utils import RepeatingLoader, log_dist  # noqa: F401
