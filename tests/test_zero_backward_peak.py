"""Peak memory DURING backward at every ZeRO stage, measured against the ZeRO formulas (2 dp ranks).

A user's model (8 bias-free 1024 × 1024 linears: Ψ = 8.4M parameters, 4 MiB of fp32 per layer, activations
of a few KiB) goes through `megazero.initialize`; one bucket holds exactly one layer. Each rank runs one
step (so every buffer exists), then measures a second step's backward alone: the resident set's peak
(Linux clear_refs + VmHWM, every allocation above 64 KiB mmapped so that freed memory leaves the set)
above the resident set after forward. That rise is what backward allocates on top of the model states:

- stages 0-1: the full fp32 gradient buffer (4Ψ) exists before backward; backward adds only autograd's
  own gradient of one parameter, alive until its hook has added it into the buffer;
- stage 2 without overlap_comm: the fp32 gradient shard (4Ψ/Nd) exists before backward; backward adds
  ONE bucket being filled and either autograd's gradient of one parameter (while the hook adds it) or
  one reduce-scatter's working memory (the hook drops autograd's gradient before the bucket's
  reduction launches): each bucket is reduce-scattered into the shard and freed as soon as it is complete;
- stage 2 with overlap_comm: the bucket being filled and autograd's gradient of one parameter, plus up to
  FlatGroup.MAX_INFLIGHT reductions alive (the oldest is finished before another is launched), each
  holding its reduce-scatter's working memory and, once it has landed, its output shard (bucket/Nd);
- stage 3: stage 2's gradient terms plus the gathered weights of the layer being differentiated and
  of the prefetched next one (a bucket each) and one all-gather's working memory.

A collective's working memory is measured alone in the same rank (the most of three reduce-scatters of a
bucket into its shard, and of three all-gathers of a shard into a bucket): gloo copies through temporaries of about 1.4 and
1.7 buckets here, where NCCL works in place and the output shard (bucket/Nd) is all there is.

Bounds: those terms plus 1 MiB of slack (Python's and the allocator's own; the gloo temporaries vary
by ±0.4 MiB between repeats), a quarter of the bucket that separates one bucket from two, and, from below, at
least one bucket at stages 2-3 (it was allocated: the measurement sees it).
"""
import pytest

from tests.harness import run_ranks

LAYERS, WIDTH = 8, 1024
LAYER = WIDTH * WIDTH  # elements of one layer's weight = one bucket
SLACK = 1024 * 1024  # the collectives' measured working memory varies by ±0.4 MiB between repeats


def _kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _rise(fn) -> int:
    """Bytes the resident set peaks above its current size while fn() runs."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _kib("VmRSS") * 1024
    fn()
    return _kib("VmHWM") * 1024 - before


def worker(cases):
    """Every case in turn in these rank processes (one launch): {(stage, overlap): measurements}."""
    import gc

    import torch

    import megazero
    from tests.harness import mmap_large_allocations

    mmap_large_allocations()
    bucket, shard = torch.ones(LAYER), torch.zeros(LAYER // 2)
    out = {}
    for stage, overlap in cases:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": stage, "overlap_comm": overlap, "reduce_bucket_size": LAYER,
                                        "allgather_bucket_size": LAYER, "stage3_prefetch_bucket_size": LAYER,
                                        "stage3_param_persistence_threshold": 0}}
        engine, *_ = megazero.initialize(model=model, model_parameters=model.parameters(), config=config)
        x = torch.randn(1, WIDTH)
        rise = {"backward": float("inf")}
        for step in range(3):
            loss = engine(x).square().mean()
            if step >= 1:  # measure this backward alone, twice: the least of two identical backwards (the
                states = engine.optimizer.memory_breakdown()  # gloo temporaries vary between repeats)
                rise["backward"] = min(rise["backward"], _rise(lambda: engine.backward(loss)))
            else:
                engine.backward(loss)
            engine.step()
        rise["reduce_scatter"] = max(_rise(lambda: torch.distributed.reduce_scatter_tensor(shard, bucket))
                                     for _ in range(3))
        rise["all_gather"] = max(_rise(lambda: torch.distributed.all_gather_into_tensor(bucket, shard))
                                 for _ in range(3))
        out[(stage, overlap)] = {"rise": rise, "states": states}
        del engine, model, loss
        gc.collect()
    return out


CASES = [(0, False), (1, False), (2, False), (2, True), (3, False)]


@pytest.fixture(scope="module")
def measured():
    return run_ranks(worker, 2, CASES, timeout=300)


@pytest.mark.parametrize("stage,overlap", CASES)
def test_peak_during_backward_is_the_formula(measured, stage, overlap):
    from megazero.zero.flat_group import FlatGroup

    bucket, param, dp = 4 * LAYER, 4 * LAYER, 2
    full_grads = 4 * LAYER * LAYERS
    for rank, r in enumerate(per_rank[(stage, overlap)] for per_rank in measured):
        rs, ag = r["rise"]["reduce_scatter"], r["rise"]["all_gather"]
        if stage <= 1:
            expected, grads_before = param, full_grads
        elif stage == 2:
            # with overlap, MAX_INFLIGHT reductions alive while a bucket fills, each its rs and output shard
            # without: autograd's gradient is dropped before its bucket's reduction launches
            working = param + FlatGroup.MAX_INFLIGHT * (rs + bucket // dp) if overlap else max(param, rs)
            expected, grads_before = bucket + working, full_grads // dp
        else:
            expected, grads_before = bucket + max(param, rs) + 2 * bucket + ag, full_grads // dp
        rise, grads = r["rise"]["backward"], r["states"]["grads"]
        print(f"stage {stage} overlap {overlap} rank {rank}: grads held before backward {grads / 2**20:.2f} MiB "
              f"(formula {grads_before / 2**20:.2f}); backward's rise {rise / 2**20:.2f} MiB "
              f"(formula {expected / 2**20:.2f} MiB; one bucket {bucket / 2**20:.2f} MiB, gloo reduce-scatter "
              f"{rs / 2**20:.2f} MiB, all-gather {ag / 2**20:.2f} MiB; all gradients {full_grads / 2**20:.2f} MiB)")
        assert grads == grads_before
        assert rise <= expected + SLACK, (rise, expected)
        if stage >= 2:
            assert rise >= bucket, (rise, bucket)  # the bucket really is allocated during backward


def test_overlap_keeps_at_most_max_inflight_reductions_alive(monkeypatch):
    """Pure (one process, a fake collective): asynchronous reductions finish the oldest BEFORE launching
    the next, so at most FlatGroup.MAX_INFLIGHT are ever alive, each holding a copy of its bucket as
    gloo does (the peak above counts that many), and every bucket still lands in the gradient shard."""
    import torch

    from megazero.runtime.comm import single_rank_group
    from megazero.zero import flat_group as fg

    alive, most = [], []

    class Work:
        def __init__(self, out, inp):
            self.out, self.copy = out, inp.clone()  # what gloo's reduce-scatter holds until waited for

        def wait(self):
            self.out.copy_(self.copy)
            alive.remove(self)

    def reduce_scatter(out, inp, group, async_op=False, tag=None):
        work = Work(out, inp)
        alive.append(work)
        most.append(len(alive))
        if async_op:
            return work
        work.wait()
        return None

    monkeypatch.setattr(fg.comm, "reduce_scatter", reduce_scatter)
    params = [torch.nn.Parameter(torch.zeros(8)) for _ in range(6)]
    group = fg.FlatGroup("g", params, single_rank_group("dp"), 2, 8,  # stage 2, one parameter per bucket
                         pin_params=False, pin_optimizer=False)  # not offloaded: no host buffer
    assert len(group.layout.buckets) == len(params)
    for i in range(len(params)):
        group.grad_view(i).fill_(i + 1)
        group.reduce_bucket(group.grad_done(i), async_op=True)
    group.wait()
    assert max(most) == fg.FlatGroup.MAX_INFLIGHT and not alive, most
    for i in range(len(params)):
        assert torch.equal(group.grad_owned[group.layout.bucket_of(i)], torch.full((8,), i + 1.0))
