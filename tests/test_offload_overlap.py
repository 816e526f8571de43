"""ZeRO-Offload's CPU Adam overlapped with backward (megazero.zero.offload_overlap), and the step
without host synchronisation (``nonfinite="ignore"``, no clipping).

With the optimizer offloaded, overlap_comm on and nothing global in the step, each bucket's update
starts in a worker thread as soon as its last reduction lands. Checked at stages 1-3 on 2 ranks:
updates are in flight before backward returns, the result equals torch's Adam on one process (the
test_zero tolerances: losses 1e-5 relative, parameters 1e-5) and is bit for bit the step that
updates after backward.
"""
import pytest
import torch
import torch.distributed as dist

from megazero.core.topology import Topology
from megazero.runtime.parallel_context import ParallelContext
from megazero.zero.optimizer import ZeroOptimizer
from megazero.zero.param_groups import megatron_param_groups
from tests.harness import run_ranks
from tests.test_zero import ADAM, ADAMW, GAS, STEPS, _close, batch, make_model, reference

CASES = [(1, {}), (2, {}), (3, dict(offload_param=True, param_persistence_threshold=40))]


def _train(stage, spec, early, **kw):
    """STEPS steps of GAS micro-batches at `stage`, offloaded with overlap_comm; with `early`, the
    step has nothing global (nonfinite=ignore, no clipping) so updates start during backward.
    Returns (losses, norms, params, updates in flight when each step's last backward returned)."""
    pctx = ParallelContext(Topology(dp=dist.get_world_size()))
    model = make_model()
    units = [model[0], model[2], model[4]]
    opt = ZeroOptimizer(megatron_param_groups(model.parameters(), spec.weight_decay), pctx, stage=stage, spec=spec,
                        units=units, reduce_bucket_size=40, offload_optimizer=True, overlap_comm=True,
                        nonfinite="ignore" if early else "skip", **kw)
    assert (opt._early is not None) == early
    n, r = pctx.dp_size, pctx.dp_rank
    losses, norms, in_flight = [], [], []
    for s in range(STEPS):
        x, y = batch(s)
        xs, ys = x.chunk(n)[r], y.chunk(n)[r]
        total = torch.zeros(1)
        for i, (xm, ym) in enumerate(zip(xs.chunk(GAS), ys.chunk(GAS), strict=True)):
            opt.set_last_microbatch(i == GAS - 1)
            loss = torch.nn.functional.mse_loss(model(xm), ym) / GAS
            opt.scale_loss(loss).backward()
            if i == GAS - 1 and early:
                in_flight.append(opt._early.pending())  # started by the hooks, before after_backward
            opt.after_backward()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / n)
        norms.append(float(opt.step()["grad_norm"]))
    if opt.gatherer is not None:
        for u in range(len(units)):
            opt.gatherer._acquire(u)
    return losses, norms, [p.detach().clone() for p in model.parameters()], in_flight


def overlap_worker(spec):
    out = []
    for stage, kw in CASES:
        early = _train(stage, spec, True, **kw)
        late = _train(stage, spec, False, **kw)
        out.append((early, late))
    return out


@pytest.mark.parametrize("spec", [ADAM, ADAMW], ids=["adam", "adamw"])
def test_offloaded_adam_runs_during_backward_and_equals_the_step_after_it(spec):
    ref = reference(spec)
    for rank_result in run_ranks(overlap_worker, 2, spec, timeout=180):
        for (stage, _), (early, late) in zip(CASES, rank_result, strict=True):
            *res, in_flight = early
            assert min(in_flight) >= 1, f"stage {stage}: no update started during backward ({in_flight})"
            _close(tuple(res), ref)
            for a, b in zip(res[2], late[2], strict=True):  # bit for bit the update after backward
                assert torch.equal(a, b), f"stage {stage}"
            assert res[0] == late[0]


class _NoHostReads:
    """Within the block, reading a tensor's value on the host raises (what a device sync would be)."""

    NAMES = ("item", "__float__", "__bool__", "tolist", "__int__")

    def __enter__(self):
        self.saved = {name: getattr(torch.Tensor, name) for name in self.NAMES}

        def refuse(self, *args, **kwargs):
            raise AssertionError("the step read a tensor on the host")
        for name in self.NAMES:
            setattr(torch.Tensor, name, refuse)

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(torch.Tensor, name, fn)


def no_sync_worker(stage):
    pctx = ParallelContext(Topology(dp=dist.get_world_size()))
    model = make_model()
    out = {}
    for nonfinite in ("ignore", "skip"):
        opt = ZeroOptimizer(list(model.parameters()), pctx, stage=stage, spec=ADAM, nonfinite=nonfinite,
                            units=[model[0], model[2], model[4]])
        x, y = batch(0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.after_backward()
        try:
            with _NoHostReads():
                info = opt.step()
            out[nonfinite] = ("no host read", type(info["grad_norm"]).__name__)
        except AssertionError as exc:
            out[nonfinite] = (str(exc), None)
        for h in opt._hooks:
            h.remove()
    return out


@pytest.mark.parametrize("stage", [0, 2])
def test_the_step_reads_nothing_on_the_host_without_clipping_or_checks(stage):
    """nonfinite=ignore and no clipping: the step never reads a tensor on the host (on a GPU: never
    waits for it), and its grad_norm is a device tensor; the default check reads the norm once."""
    for out in run_ranks(no_sync_worker, 2, stage, timeout=120):
        assert out["ignore"] == ("no host read", "Tensor"), out
        assert out["skip"][0] == "the step read a tensor on the host", out
