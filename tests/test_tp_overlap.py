"""The column-parallel region's backward overlaps its input-gradient reduction with the weight GEMMs
(`megazero.tensor_parallel.column_region`), on 2 gloo ranks (tp=2).

Parity: a q/k/v-like region of three column-parallel linears sharing one entry, then a row-parallel
linear; `column_parallel_region` against the unfused composition (`enter_column_region`, then each
linear) and against the single-process model, with and without sequence parallelism, with zero-bubble
deferral, frozen weights, an input that needs no gradient, and autocast. The fused and unfused paths
must count the same communication (calls, elements, bytes). Relative error max|a - b| / max|b|:
fp32 1e-5 (measured ~1e-7), bf16 autocast 2e-2.

Ordering: an instrumented comm (the launch and the wait of every collective) and a dispatch mode
(every GEMM) record backward's events; rank 1 launches its reduction 0.5 s late, so on rank 0 the
reduction is provably still in flight while the weight GEMMs run.
"""
import contextlib
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megazero.core.topology import Topology
from megazero.runtime import comm
from megazero.runtime.comm import single_rank_group
from megazero.runtime.parallel_context import ParallelContext
from megazero.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, column_parallel_region,
                                      gather_full_grads)
from megazero.tensor_parallel.mappings import enter_column_region
from megazero.tensor_parallel.weight_grad import WeightGradStore
from tests.harness import run_ranks

TOL, BF16_TOL = 1e-5, 2e-2
S, B, H, OUT = 8, 2, 12, 16  # sequence, batch, hidden, width of each column-parallel output
DELAY = 0.5  # seconds rank 1 waits before launching its gradient reduction (ordering test)


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _model(g, sp, store=None, frozen=()):
    mods = torch.nn.ModuleDict({n: ColumnParallelLinear(H, OUT, g, sequence_parallel=sp, name=n, seed=3,
                                                        comm_input=False, wgrad_store=store) for n in "qkv"})
    mods["out"] = RowParallelLinear(OUT, H, g, bias=False, sequence_parallel=sp, name="out", seed=3,
                                    wgrad_store=store)
    for name in frozen:
        mods[name].weight.requires_grad_(False)
    return mods


def _region(mods, x, fused, g, sp):
    if fused:
        return column_parallel_region(x, (mods["q"], mods["k"], mods["v"]))
    full, rg = enter_column_region(x, g, sp, 3)
    return tuple(mods[n](full, rg) for n in "qkv")


def _step(mods, x, gy, fused, g, sp, store=None, x_grad=True, autocast=False):
    """One forward and backward; deferred weight GEMMs (zero bubble) are then added into .grad."""
    for p in mods.parameters():
        p.grad = None
    a = x.clone().requires_grad_(x_grad)
    g.stats.reset()
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with store.defer() if store is not None else contextlib.nullcontext():
        with amp:
            q, k, v = _region(mods, a, fused, g, sp)
            y = mods["out"](q * torch.tanh(k) + v)  # (s, b, h) [(s/t, b, h)]
        y.float().backward(gy)
    stats = g.stats.snapshot()
    deferred = store.take() if store is not None else []
    region_weights_deferred = all(mods[n].weight.grad is None for n in "qkv")
    for weight, gw in map(WeightGradStore.compute, deferred):
        weight.grad = gw if weight.grad is None else weight.grad + gw
    return dict(y=y.detach(), x_grad=a.grad, grads=gather_full_grads(mods, g), stats=stats,
                deferred=len(deferred), region_weights_deferred=region_weights_deferred, dtype=q.dtype)


CASES = {  # name -> step options
    "plain": {}, "defer": {"defer": True}, "frozen q": {"frozen": ("q",)}, "no input grad": {"x_grad": False},
}


def _parity_worker():
    pctx = ParallelContext(Topology(tp=2))
    g, t, r = pctx.tp_group, pctx.tp_size, pctx.tp_group.rank
    x, gy = _randn(S, B, H, seed=1), _randn(S, B, H, seed=2)  # (s, b, h), the same on every rank
    out = {}
    for name, opt in CASES.items():
        frozen, x_grad = opt.get("frozen", ()), opt.get("x_grad", True)
        ref = _step(_model(single_rank_group("tp"), False, frozen=frozen), x, gy, False, single_rank_group("tp"),
                    False, x_grad=x_grad)
        for sp in (False, True):
            mine = (lambda v: v.chunk(t, 0)[r]) if sp else (lambda v: v)
            runs = {}
            for fused in (True, False):
                store = WeightGradStore() if opt.get("defer") else None
                runs[fused] = _step(_model(g, sp, store, frozen), mine(x), mine(gy), fused, g, sp, store, x_grad)
            errs = {"y": rel(runs[True]["y"], mine(ref["y"]))}
            if x_grad:
                errs["x_grad"] = rel(runs[True]["x_grad"], mine(ref["x_grad"]))
                errs["x_grad vs unfused"] = rel(runs[True]["x_grad"], runs[False]["x_grad"])
            for k, v in ref["grads"].items():
                errs[k] = 0.0 if not v.any() and not runs[True]["grads"][k].any() else rel(runs[True]["grads"][k], v)
                errs[f"{k} vs unfused"] = rel(runs[True]["grads"][k], runs[False]["grads"][k]) if v.any() else 0.0
            out[name, sp] = dict(errs=errs, same_stats=runs[True]["stats"] == runs[False]["stats"],
                                 stats=runs[True]["stats"], deferred=runs[True]["deferred"],
                                 region_deferred=runs[True]["region_weights_deferred"])
    # autocast (bf16 on CPU), with a store (ignored under autocast)
    ref = _step(_model(single_rank_group("tp"), False), x, gy, False, single_rank_group("tp"), False)
    for sp in (False, True):
        mine = (lambda v: v.chunk(t, 0)[r]) if sp else (lambda v: v)
        runs = {}
        for fused in (True, False):
            store = WeightGradStore()
            runs[fused] = _step(_model(g, sp, store), mine(x), mine(gy), fused, g, sp, store, autocast=True)
        amp = runs[True]
        errs = {k: rel(amp["grads"][k], v) for k, v in ref["grads"].items()}
        errs["x_grad"] = rel(amp["x_grad"], mine(ref["x_grad"]))
        out["autocast", sp] = dict(errs=errs, same_stats=amp["stats"] == runs[False]["stats"], dtype=amp["dtype"],
                                   deferred=amp["deferred"] + runs[False]["deferred"],
                                   vs_unfused=max(rel(amp["grads"][k], runs[False]["grads"][k]) for k in ref["grads"]))
    # bf16 parameters: the fused region rounds and sums as autograd does, bit for bit the unfused one
    for sp in (False, True):
        mine = (lambda v: v.chunk(t, 0)[r]) if sp else (lambda v: v)
        runs = {fused: _step(_model(g, sp).to(torch.bfloat16), mine(x).bfloat16(), mine(gy), fused, g, sp)
                for fused in (True, False)}
        out["bf16", sp] = torch.equal(runs[True]["x_grad"], runs[False]["x_grad"]) and all(
            torch.equal(runs[True]["grads"][k], runs[False]["grads"][k]) for k in runs[True]["grads"])
    return out


@pytest.fixture(scope="module")
def parity():
    return run_ranks(_parity_worker, 2, timeout=90)


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_region_matches_unfused_and_single_process(parity, case, sp):
    for rank_res in parity:
        res = rank_res[case, sp]
        assert max(res["errs"].values()) < TOL, res["errs"]
        assert res["same_stats"], res["stats"]  # the same collectives, elements and bytes as unfused
        ops = {k.split("/")[1]: v["calls"] for k, v in res["stats"].items()}
        if sp:  # forward: all-gather, g's reduce-scatter; backward: g's all-gather, the re-gather, one reduction
            assert ops == {"all_gather": 3, "reduce_scatter": 1 + (case != "no input grad")}, ops
        else:
            assert ops == {"all_reduce": 1 + (case != "no input grad")}, ops


def test_fused_region_defers_its_weight_gemms_to_the_store(parity):
    for rank_res in parity:
        for sp in (False, True):
            res = rank_res["defer", sp]
            assert res["deferred"] == 4 and res["region_deferred"]  # q, k, v and out: all in W
            assert rank_res["plain", sp]["deferred"] == 0


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_fused_region_under_autocast(parity, sp):
    for rank_res in parity:
        res = rank_res["autocast", sp]
        assert res["dtype"] == torch.bfloat16 and res["deferred"] == 0  # autocast: weight GEMMs in B
        assert res["same_stats"]  # the region's reduction in the input's dtype (fp32), as f's
        assert max(res["errs"].values()) < BF16_TOL, res["errs"]
        assert res["vs_unfused"] < BF16_TOL


class _Recorder(TorchDispatchMode):
    """Backward's events in order: ("launch"|"wait", op) from the instrumented comm, ("dgrad"|"wgrad",
    reduction in flight) for each GEMM (told apart by the shape of its result)."""

    def __init__(self, wgrad_shape):
        super().__init__()
        self.wgrad_shape, self.events, self.reductions = wgrad_shape, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            kind = "wgrad" if tuple(result.shape) == self.wgrad_shape else "dgrad"
            self.events.append((kind, any(not w.is_completed() for w in self.reductions)))
        return result


class _Tracked:
    def __init__(self, work, op, rec):
        self.work, self.op, self.rec = work, op, rec

    def wait(self):
        self.work.wait()
        self.rec.events.append(("wait", self.op))


@contextlib.contextmanager
def _instrumented_comm(rec, late: bool):
    """comm's collectives record their launch (and, when async, their wait) into `rec`; with `late`,
    gradient reductions start DELAY seconds late."""
    originals = {op: getattr(comm, op) for op in ("all_reduce", "reduce_scatter", "all_gather")}

    def wrap(op, fn):
        def launch(*args, **kwargs):
            if late and op != "all_gather":
                time.sleep(DELAY)
            work = fn(*args, **kwargs)
            rec.events.append(("launch", op))
            if work is None:  # a synchronous call
                return None
            if op != "all_gather":
                rec.reductions.append(work)
            return _Tracked(work, op, rec)
        return launch
    try:
        for op, fn in originals.items():
            setattr(comm, op, wrap(op, fn))
        yield
    finally:
        for op, fn in originals.items():
            setattr(comm, op, fn)


def _ordering_worker():
    pctx = ParallelContext(Topology(tp=2))
    g, t, r = pctx.tp_group, pctx.tp_size, pctx.tp_group.rank
    out = {}
    for sp in (False, True):
        for fused, defer in ((True, False), (True, True), (False, False)):
            store = WeightGradStore() if defer else None
            mods = _model(g, sp, store)
            x = _randn(S, B, H, seed=1)
            x = (x.chunk(t, 0)[r] if sp else x).requires_grad_()
            with store.defer() if store is not None else contextlib.nullcontext():
                ys = _region(mods, x, fused, g, sp)  # (s, b, out/t) each
                loss = sum((y * _randn(*y.shape, seed=5 + i)).sum() for i, y in enumerate(ys))
                rec = _Recorder((OUT // t, H))
                comm.barrier(g)  # both ranks start backward together: only rank 1's DELAY separates them
                with _instrumented_comm(rec, late=fused and r == 1), rec:
                    loss.backward()
            out[sp, fused, defer] = rec.events
    return out


@pytest.fixture(scope="module")
def ordering():
    return run_ranks(_ordering_worker, 2, timeout=90)


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_reduction_is_launched_before_the_weight_gemms_and_waited_after(ordering, sp):
    reduction = "reduce_scatter" if sp else "all_reduce"
    for rank, res in enumerate(ordering):
        events = res[sp, True, False]
        names = [e if e[0] in ("launch", "wait") else e[0] for e in events]
        expected = ["dgrad"] * 3 + [("launch", reduction)]
        if sp:  # the shard's re-gather is launched before the input GEMMs and waited before the weight GEMMs
            expected = [("launch", "all_gather")] + expected + [("wait", "all_gather")]
        assert names == expected + ["wgrad"] * 3 + [("wait", reduction)], events
        if rank == 0:  # rank 1 launches 0.5 s late: every weight GEMM ran while the reduction was in flight
            assert all(pending for kind, pending in events if kind == "wgrad"), events


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_deferred_region_launches_and_waits_with_no_gemm_between(ordering, sp):
    reduction = "reduce_scatter" if sp else "all_reduce"
    for res in ordering:
        names = [e if e[0] in ("launch", "wait") else e[0] for e in res[sp, True, True]]
        core = ["dgrad"] * 3 + [("launch", reduction)] + ([("wait", "all_gather")] if sp else [])
        assert names == ([("launch", "all_gather")] if sp else []) + core + [("wait", reduction)], names


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_unfused_region_reduces_only_after_every_weight_gemm(ordering, sp):
    """The composition the fused region replaces: f's reduction starts after the linears' whole backward."""
    reduction = "reduce_scatter" if sp else "all_reduce"
    for res in ordering:
        kinds = [e[0] if e[0] in ("dgrad", "wgrad") else e for e in res[sp, False, False]]
        assert kinds.count("wgrad") == 3 and kinds.index(("launch", reduction)) > max(
            i for i, k in enumerate(kinds) if k == "wgrad"), kinds


def test_tp1_region_is_plain_linears_without_communication():
    """One TP rank: each linear is called as a module (its hooks run); under autocast a store is ignored."""
    g = single_rank_group("tp")
    store = WeightGradStore()
    mods = _model(g, False, store)
    x = _randn(S, B, H, seed=1)
    called = []
    mods["k"].register_forward_hook(lambda mod, args, out: called.append(mod))
    ys = column_parallel_region(x, (mods["q"], mods["k"]))
    assert all(torch.equal(y, torch.nn.functional.linear(x, mods[n].weight, mods[n].bias)) for y, n in zip(ys, "qk", strict=True))
    assert called == [mods["k"]] and g.stats.snapshot() == {}
    with torch.autocast("cpu", dtype=torch.bfloat16), store.defer():
        ys = column_parallel_region(x, (mods["q"], mods["k"]))
        sum(y.float().sum() for y in ys).backward()
    assert ys[0].dtype == torch.bfloat16 and store.take() == [] and mods["q"].weight.grad is not None


def test_region_linears_must_share_group_and_store():
    g = single_rank_group("tp")
    a = ColumnParallelLinear(H, OUT, g, name="a")
    b = ColumnParallelLinear(H, OUT, g, name="b", wgrad_store=WeightGradStore())
    with pytest.raises(ValueError, match="must share"):
        column_parallel_region(torch.zeros(2, H), (a, b))


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_fused_region_in_bf16_is_bit_for_bit_the_unfused_one(parity, sp):
    """In bf16 a chain of addmm would accumulate the input gradient in fp32 and so differ from one
    process's run (which sums the rounded products as autograd does); the region does the latter."""
    for res in parity:
        assert res["bf16", sp]
