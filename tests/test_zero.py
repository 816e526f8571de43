"""ZeRO stages 0-3 on the data axis with a small MLP: parity with torch's own optimizers on one
process, exact communication volumes, memory by stage, loss scaling and overflow agreement.

Tolerances (fp32): per-step losses within 1e-5 relative, final parameters within 1e-5 absolute
(the parameters are O(0.1-1)); the differences come only from the order of float additions in
the data-parallel reduction.
"""

import math

import pytest
import torch
import torch.distributed as dist

from megazero.core.config import load_config
from megazero.engine.factories import build_optimizer
from megazero.runtime.parallel_context import ParallelContext
from megazero.core.topology import Topology
from megazero.zero.flat_group import host_pinned
from megazero.zero.optimizer import OptimizerSpec, ZeroOptimizer
from megazero.zero.param_groups import megatron_param_groups
from tests.harness import run_ranks

STEPS, GAS, BATCH = 4, 2, 16


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                            torch.nn.Linear(32, 4))
    return m.to(dtype)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def torch_optimizer(model, spec: OptimizerSpec):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if spec.type == "sgd":
        return torch.optim.SGD(groups, lr=spec.lr, momentum=spec.momentum)
    cls = torch.optim.AdamW if spec.type == "adamw" else torch.optim.Adam
    return cls(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps)


def reference(spec, clip=0.0, steps=STEPS):
    """One process, torch's optimizer, the whole global batch in GAS micro-batches."""
    model = make_model()
    opt = torch_optimizer(model, spec)
    losses, norms = [], []
    for s in range(steps):
        x, y = batch(s)
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x.chunk(GAS), y.chunk(GAS), strict=True):
            loss = torch.nn.functional.mse_loss(model(xm), ym) / GAS
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf")).item())
        losses.append(total)
        opt.step()
    return losses, norms, [p.detach().clone() for p in model.parameters()]


def zero_worker(stage, spec, steps=STEPS, clip=0.0, **kw):
    pctx = ParallelContext(Topology(dp=dist.get_world_size()))
    model = make_model()
    units = [model[0], model[2], model[4]]
    opt = ZeroOptimizer(megatron_param_groups(model.parameters(), spec.weight_decay), pctx, stage=stage, spec=spec,
                        gradient_clipping=clip, units=units, **kw)
    n, r = pctx.dp_size, pctx.dp_rank
    losses, norms = [], []
    for s in range(steps):
        x, y = batch(s)
        xs, ys = x.chunk(n)[r], y.chunk(n)[r]
        total = torch.zeros(1)
        for i, (xm, ym) in enumerate(zip(xs.chunk(GAS), ys.chunk(GAS), strict=True)):
            opt.set_last_microbatch(i == GAS - 1)
            loss = torch.nn.functional.mse_loss(model(xm), ym) / GAS
            opt.scale_loss(loss).backward()
            opt.after_backward()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / n)
        norms.append(opt.step()["grad_norm"])
    if opt.gatherer is not None:
        for u in range(len(units)):
            opt.gatherer._acquire(u)
    return losses, norms, [p.detach().clone() for p in model.parameters()]


def _close(res, ref):
    losses, norms, params = res
    ref_losses, ref_norms, ref_params = ref
    for a, b in zip(losses, ref_losses, strict=True):
        # the module docstring's fp32 tolerances: the data-parallel reduction adds in another order; norms are sums of squares in fp64 (test_grad_norm_* below), so 1e-6
        assert abs(a - b) <= 1e-5 * abs(b), (losses, ref_losses)
    for a, b in zip(norms, ref_norms, strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), (norms, ref_norms)
    for a, b in zip(params, ref_params, strict=True):
        assert (a - b).abs().max().item() <= 1e-5


SGD = OptimizerSpec("sgd", lr=0.1, momentum=0.9, weight_decay=0.01)
ADAMW = OptimizerSpec("adamw", lr=1e-2, weight_decay=0.1)
ADAM = OptimizerSpec("adam", lr=1e-2, weight_decay=0.0)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4])
def test_stage_parity_with_torch_adamw(stage, dp):
    ref = reference(ADAMW, clip=0.5)
    for res in run_ranks(zero_worker, dp, stage, ADAMW, clip=0.5, reduce_bucket_size=300, timeout=120):
        _close(res, ref)


@pytest.mark.parametrize("stage, kw", [
    (1, dict(overlap_comm=True)), (2, dict(overlap_comm=True)), (3, dict(overlap_comm=True)),
    (0, dict(overlap_comm=True)), (1, dict(offload_optimizer=True)), (2, dict(offload_optimizer=True)),
    (3, dict(offload_optimizer=True, offload_param=True, param_persistence_threshold=40)),
    (1, dict(allgather_bucket_size=450)), (2, dict(allgather_bucket_size=1)),
])
def test_overlap_and_offload_parity(stage, kw):
    ref = reference(ADAM)
    for res in run_ranks(zero_worker, 2, stage, ADAM, reduce_bucket_size=200, **kw, timeout=120):
        _close(res, ref)


def test_offload_host_buffers_are_pinned_when_the_flag_asks_and_cuda_exists():
    """`host_pinned`, the one decision every offloaded host buffer is allocated by, with a stand-in CUDA
    availability: pinned only when the pin_memory flag is set and CUDA is available."""
    table = {(flag, cuda): host_pinned(flag, cuda) for flag in (False, True) for cuda in (False, True)}
    assert table == {(False, False): False, (False, True): False, (True, False): False, (True, True): True}


def offload_pin_worker(zero: dict):
    """build_optimizer (the engine's factory) from a config with `zero`: per flat group, the pin flags it
    received and whether each of its host buffers is page-locked (None: not on the host / not made)."""
    cfg = load_config({"zero": {"param_persistence_threshold": 0, **zero}}, world_size=dist.get_world_size())
    pctx = ParallelContext(Topology(dp=dist.get_world_size()))
    model = make_model().to("cuda" if torch.cuda.is_available() else "cpu")
    opt = build_optimizer(cfg, model, pctx)
    out = {}
    for g in opt.groups:
        g.host_grad_async(0)  # an offload from CUDA makes its gradient staging buffer here
        shard = g.param_shard if g.shard_params and g.param_shard.device.type == "cpu" else None
        out[g.name] = (g.pin_params, g.pin_optimizer, shard is not None and shard.is_pinned(),
                       g.master_flat.is_pinned() if g.separate_master else None, g.state_flat.is_pinned(),
                       g._host_grad.is_pinned() if g._host_grad is not None else None)
    return out


@pytest.mark.parametrize("zero, pins", [
    # (config's zero section, (pin_params, pin_optimizer) the groups get)
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, (True, True)),  # the default: pinned, as DeepSpeed's
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}, (False, False)),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
      "offload_param": {"device": "cpu", "pin_memory": False}}, (False, True)),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
      "offload_param": {"device": "cpu", "pin_memory": True}}, (True, False)),
    # one offload only: its flag for every host buffer, the other key's ignored (nothing of it on the host)
    ({"stage": 3, "offload_optimizer": {"device": "none", "pin_memory": False},
      "offload_param": {"device": "cpu", "pin_memory": True}}, (True, True)),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
      "offload_param": {"device": "none", "pin_memory": True}}, (False, False)),
])
def test_offload_pin_memory_keys_reach_the_flat_groups(zero, pins):
    """zero.offload_*.pin_memory pass through the engine's optimizer factory and ZeroOptimizer into
    every FlatGroup, and each host buffer is page-locked exactly when `host_pinned` says (on a CPU-only
    machine: never; on a CUDA machine: when its flag is set)."""
    (groups,) = run_ranks(offload_pin_worker, 1, zero, timeout=120)
    assert set(groups) == ({"sharded"} if zero["stage"] == 3 else {"main"})
    cuda = torch.cuda.is_available()
    for name, (pin_params, pin_optimizer, shard, master, state, staging) in groups.items():
        assert (pin_params, pin_optimizer) == pins, name
        if zero["stage"] == 3:  # the parameter shard is on the host (either offload puts it there)
            assert shard == host_pinned(pin_params, cuda), name
        assert master is not None, name  # offloaded: a separate fp32 master on the host
        assert master == state == host_pinned(pin_optimizer, cuda), name
        assert staging == (host_pinned(pin_optimizer, cuda) if cuda else None), name


def test_sgd_parity():
    ref = reference(SGD)
    for res in run_ranks(zero_worker, 2, 2, SGD, timeout=120):
        _close(res, ref)


def gather_calls_worker(allgather_bucket_size):
    pctx = ParallelContext(Topology(dp=dist.get_world_size()))
    model = make_model()
    opt = ZeroOptimizer(list(model.parameters()), pctx, stage=1, spec=ADAM, reduce_bucket_size=20,
                        allgather_bucket_size=allgather_bucket_size)
    x, y = batch(0)
    torch.nn.functional.mse_loss(model(x.chunk(2)[pctx.dp_rank]), y.chunk(2)[pctx.dp_rank]).backward()
    opt.after_backward()
    pctx.stats.reset()
    opt.step()
    ag = pctx.stats.total("dp", "all_gather")
    return ag.calls, ag.elements, len(opt.groups[0].layout.buckets)


def test_parameter_all_gathers_go_bucket_by_bucket_into_the_flat_buffer():
    """One in-place all-gather per reduce bucket whatever allgather_bucket_size (which only bounds the
    elements in flight); the volume is the same either way, and parity holds at both sizes
    (test_overlap_and_offload_parity)."""
    (small, vol_small, buckets), _ = run_ranks(gather_calls_worker, 2, 1, timeout=60)
    (large, vol_large, _), _ = run_ranks(gather_calls_worker, 2, 10**9, timeout=60)
    assert buckets >= 4 and small == buckets and large == buckets
    assert vol_small == vol_large


def test_grad_norm_is_accurate_whatever_the_range_lengths():
    """The global gradient norm accumulates each range in fp64: torch's CPU fp32 norm has no cascade
    summation (3e-5 relative error at 1M elements), which made the norm depend on the layout's ranges."""
    torch.manual_seed(0)
    sizes = [4_000_000, 1_000_000, 3]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    grads = [torch.randn(n) * 1e-3 + 2e-3 for n in sizes]
    exact = math.sqrt(sum(g.double().square().sum().item() for g in grads))
    opt = ZeroOptimizer(params, ParallelContext(Topology()), stage=0, spec=OptimizerSpec("sgd", lr=0.0))
    sum((p * g).sum() for p, g in zip(params, grads, strict=True)).backward()  # d/dp = g
    opt.after_backward()
    opt.reduce_grads()
    # fp64 accumulation against an fp64 reference: the per-range sums add in another order, ~1e-16 each
    assert abs(opt.global_grad_norm() - exact) / exact < 1e-12


@pytest.mark.parametrize("sizes,bucket", [([4_194_304], 500_000_000), ([2_097_152, 2_097_152], 2_097_152),
                                          ([1_000_003, 2_999_999, 194_302], 1_000_003)])
def test_grad_norm_of_one_gradient_cut_into_different_ranges(sizes, bucket):
    """One 4M-element gradient cut into parameters and buckets in different ways (as layouts cut it into
    different owned ranges) has the same global norm as its fp64 reference (fp32 per-range norms missed
    it by up to 1.4e-4 relative)."""
    torch.manual_seed(0)
    full = torch.randn(sum(sizes)) * 1e-3 + 2e-3
    exact = full.double().square().sum().sqrt().item()
    grads = list(full.split(sizes))
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    opt = ZeroOptimizer(params, ParallelContext(Topology()), stage=0, spec=OptimizerSpec("sgd", lr=0.0),
                        reduce_bucket_size=bucket)
    sum((p * g).sum() for p, g in zip(params, grads, strict=True)).backward()  # d/dp = g
    opt.after_backward()
    opt.reduce_grads()
    # fp64 accumulation against an fp64 reference: the per-range sums add in another order, ~1e-16 each
    assert abs(opt.global_grad_norm() - exact) / exact < 1e-12
