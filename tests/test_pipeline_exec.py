"""Pipeline executor on gloo with a toy layer list: every schedule at pp=2 and pp=4 gives the
single-process losses and gradients (fp32, 1e-5 relative), tied weights included; a killed rank
makes the others fail with their program position instead of hanging."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from megazero.runtime.parallel_context import ParallelContext
from megazero.pipeline.executor import PipelineExecutor
from megazero.pipeline.pipeline_module import LayerSpec, PipelineModule, TiedLayerSpec
from megazero.pipeline.p2p import PipeP2P
from megazero.core.schedules import get_schedule
from megazero.core.topology import Topology
from megazero.zero.optimizer import OptimizerSpec, ZeroOptimizer
from tests.harness import RankError, run_ranks

VOCAB, HID, SEQ, MB = 11, 8, 5, 2


class Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.weight = torch.nn.Parameter(torch.randn(VOCAB, HID, generator=g) * 0.5)

    def forward(self, ids):
        return self.weight[ids]

    def head(self, x):
        return x @ self.weight.t()


class Block(torch.nn.Module):
    def __init__(self, i):
        super().__init__()
        g = torch.Generator().manual_seed(10 + i)
        self.fc = torch.nn.Linear(HID, HID)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(HID, HID, generator=g) * 0.3)
            self.fc.bias.copy_(torch.randn(HID, generator=g) * 0.1)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def layers(n_blocks):
    return ([TiedLayerSpec("embed", Embed)] + [LayerSpec(Block, i) for i in range(n_blocks)]
            + [TiedLayerSpec("embed", Embed, forward_fn=lambda m, x: m.head(x))])


def microbatches(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (m, MB, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (m, MB, SEQ), generator=g)
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(m)]


def reference(n_blocks, m):
    model = PipelineModule(layers(n_blocks), 1, 0, loss_fn)
    total = 0.0
    for b in microbatches(m):
        loss = model(b) / m
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in _named(model, 0, n_blocks)}


def _named(model, stage, n_blocks):
    """Gradients by layer index: tied embedding under 'embed'."""
    out = []
    for c, (lo, hi) in enumerate(model.layer_ranges):
        for idx, mod in zip(range(lo, hi), model.local_chunks[c], strict=True):
            for pname, p in mod.named_parameters():
                key = "embed" if isinstance(mod, Embed) else f"{idx}.{pname}"
                out.append((key, p))
    return out


def pipe_worker(schedule, n_blocks, m, chunks=1, kill_rank=None):
    pp = dist.get_world_size()
    pctx = ParallelContext(Topology(pp=pp), timeout_s=20)
    model = PipelineModule(layers(n_blocks), pp, pctx.pp_rank, loss_fn, "uniform", chunks=chunks)
    opt = ZeroOptimizer(list(model.parameters()), pctx, stage=0, spec=OptimizerSpec("sgd", lr=0.0))
    grads = {}
    program = get_schedule(schedule, pp, m, chunks)[pctx.pp_rank]
    ex = PipelineExecutor(model, PipeP2P(pctx.pp_group, (MB, SEQ, HID), torch.float32), opt, pctx.pp_rank, pp,
                          rank=pctx.global_rank)
    if kill_rank is not None and pctx.global_rank == kill_rank:
        os._exit(1)
    opt.step = lambda: {"skipped": False}  # keep the reduced gradients for inspection
    st = ex.run(program, iter(microbatches(m)), m)
    for key, p in _named(model, pctx.pp_rank, n_blocks):
        g, i = opt._where[id(p)]
        s, e = g.layout.param_range(i)
        grads[key] = g.grad_flat[s:e].view_as(p).clone()
    losses = [l.item() for l in st.losses]
    return (sum(losses) / m if losses else None), grads


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule, chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_schedules_match_single_process(pp, schedule, chunks):
    n_blocks, m = 6, 4
    ref_loss, ref_grads = reference(n_blocks, m)
    results = run_ranks(pipe_worker, pp, schedule, n_blocks, m, chunks, timeout=90)
    seen = set()
    for loss, grads in results:
        if loss is not None:
            # fp32 against one process: the stages' sums in another order (the parity suites' 1e-5; gradients relative to each tensor's largest entry)
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
        for key, g in grads.items():
            ref = ref_grads[key]
            assert (g - ref).abs().max() <= 1e-5 * ref.abs().max(), key
            seen.add(key)
    assert seen == set(ref_grads)


def test_killed_rank_makes_the_others_fail_fast():
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        run_ranks(pipe_worker, 2, "1f1b", 4, 4, 1, 1, timeout=60)
    msg = str(err.value)
    # rank 1 died; rank 0 reports where it was waiting (either report may arrive first)
    assert "rank 1 of 2 failed: died with exit code 1" in msg or "rank 1 also failed: died with exit code 1" in msg
    assert "PipelineError: stage 0 (rank 0) waiting at SendAct mb 0 to stage 1" in msg
    assert time.monotonic() - t0 < 45
