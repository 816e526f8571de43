"""peak_memory: each rank's resident-set peak DURING a training step at ZeRO 0-3, megazero against
DeepSpeed with the same config, next to the ZeRO paper's model-state formulas.

Model: a stack of square nn.Linear layers (Ψ parameters, fp32) trained on one row per rank, so the
activations are a few KiB and the step's memory is the model states and the communication buffers.
Method: one launch per (framework, stage), alternating megazero and DeepSpeed, 4 ranks. Each rank
first makes glibc return large blocks to the OS when freed (`mmap_large_allocations`), builds and
trains a tiny engine of the same framework and stage (so the libraries and first calls that
initialize loads stay out of the figure), drops it and records its resident set (the base); then
it builds the model and the engine and trains one warm-up step (allocating the optimizer states). Each measured step resets
the kernel's peak (`clear_refs` 5) right before it and reads VmHWM right after: peak - base is what
the step held at its highest, persistent states included (the JSON also has what was held just
before and just after each step). A repeat's figure is the highest rank's.

Formulas (bytes, fp32 Adam, N ranks). The model states are the ZeRO paper's: stage 0: 16Ψ (4
parameters + 4 gradients + 8 Adam moments); stage 1: 4Ψ + 4Ψ + 8Ψ/N; stage 2: 4Ψ + 4Ψ/N + 8Ψ/N;
stage 3: 16Ψ/N. A step also holds a working set at its highest moment, which the formula adds term by
term: G = autograd's own gradient of the largest parameter (alive until its hook has added it into
the flat buffer), B = 4 × the largest reduce bucket of megazero's layout (`build_layout` at
reduce_bucket_size; a bucket closes once it holds at least that many elements; at stage 3 also at
every layer), L = 4 × one layer's
parameters, and the collectives' working memory RS (a reduce-scatter of a B-sized bucket) and AG (an
all-gather into one), measured alone in the same rank (gloo copies through temporaries; NCCL would not).
A reduction of a bucket holds R = RS + B/N until it is waited for: gloo's copy of the bucket (RS) and
the output shard megazero allocates for it (B/N; RS is measured into a shard already resident), both
alive when the result lands, before the shard is added into the gradient shard and freed. With
overlap_comm (set here as DeepSpeed and megazero default it: at stage 3 only) up to
`FlatGroup.MAX_INFLIGHT` = M reductions are alive while the next bucket fills (the oldest is finished
before another is launched), else one.
stage 0: max(G, AR) (backward, or the gradient all-reduce); stage 1: max(G, RS + B/N, AG); stage 2:
max(B + max(G, R), AG) without overlap (the bucket being filled, then its reduction: the hook drops
autograd's gradient before the reduction launches), B + G + M·R with it; stage 3: 2L + B + G + M·R + AG (the
layer being differentiated and the prefetched one, whose all-gather is in flight, the bucket just
filled, autograd's gradient still held by its hook, and the M previous buckets' reductions in flight).
Check: the losses of the measured steps agree between the two (rel 1e-4) before a ratio is shown.
"""
from __future__ import annotations

import torch
from torch import nn

from benchmarks import _common as C

TOL = 1e-4
FRAMEWORKS = ("megazero", "deepspeed")


def layers(width: int, count: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(count)])


def config(stage: int, bucket: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "steps_per_print": 10 ** 9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "overlap_comm": overlaps(stage),
                                  "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                                  "stage3_prefetch_bucket_size": bucket, "stage3_param_persistence_threshold": 10_000}}


def overlaps(stage: int) -> bool:
    """overlap_comm as DeepSpeed and megazero resolve it when unset (true at stage 3 only), made explicit
    because the formula depends on it."""
    return stage == 3


def worker(framework: str, stage: int, width: int, count: int, bucket: int, steps: int):
    import torch.distributed as dist

    C.mmap_large_allocations()
    rank, world = dist.get_rank(), dist.get_world_size()
    if framework == "megazero":
        import megazero as deepspeed
    else:
        import deepspeed
    g = torch.Generator().manual_seed(5)

    def train(width, count, steps):
        """(engine, step(i) -> loss) of a fresh model on `steps` global batches."""
        model = layers(width, count)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config(stage, bucket))
        data = [(torch.randn(world, width, generator=g), torch.randn(world, width, generator=g)) for _ in range(steps)]

        def step(i):
            x, y = data[i]
            loss = nn.functional.mse_loss(engine(x[rank:rank + 1]), y[rank:rank + 1])
            engine.backward(loss)
            engine.step()
            return float(loss.detach())
        return engine, step

    # a tiny engine first: the libraries and first calls initialize and a step load stay out of the figure
    engine, step = train(64, 2, 1)
    step(0)
    del engine, step
    base = C.rss_now()
    engine, step = train(width, count, steps + 1)
    losses = [step(0)]
    peaks, before, held = [], [], []
    for i in range(1, steps + 1):
        dist.barrier()
        before.append(C.reset_peak() - base)
        losses.append(step(i))
        peaks.append(C.peak_rss() - base)
        held.append(C.rss_now() - base)
    del engine, step
    return {"peak_bytes": peaks, "held_before_step_bytes": before, "held_after_step_bytes": held, "losses": losses,
            "collectives_bytes": collective_working_memory(_largest_bucket(width, count, bucket, world, stage), world)}


def _largest_bucket(width: int, count: int, bucket: int, world: int, stage: int) -> int:
    """Elements of the largest reduce bucket megazero's layout makes of these layers (reverse order;
    ZeRO-3 also cuts a bucket at every layer, its unit of gathering)."""
    from megazero.core.flat_buffer import build_layout

    numels = [n for _ in range(count) for n in (width, width * width)]  # bias, weight: backward order
    cuts = range(2, 2 * count, 2) if stage == 3 else ()
    return max(b.numel for b in build_layout(numels, world, bucket, cuts).buckets)


def collective_working_memory(numel: int, world: int) -> dict:
    """The resident-set rise of one all-reduce, reduce-scatter and all-gather of a `numel` fp32 bucket
    (the most of three each), measured alone on this rank: the backend's own temporaries."""
    import torch.distributed as dist

    full, shard = torch.ones(numel - numel % world), torch.zeros(numel // world)

    def rise(fn):
        base = C.reset_peak()
        fn()
        return C.peak_rss() - base
    return {"all_reduce": max(rise(lambda: dist.all_reduce(full)) for _ in range(3)),
            "reduce_scatter": max(rise(lambda: dist.reduce_scatter_tensor(shard, full)) for _ in range(3)),
            "all_gather": max(rise(lambda: dist.all_gather_into_tensor(full, shard)) for _ in range(3)),
            "bucket_bytes": 4 * numel}


def model_states(stage: int, psi: int, n: int) -> int:
    """The ZeRO paper's model states per rank, fp32 Adam (bytes)."""
    return {0: 16 * psi, 1: 8 * psi + 8 * psi // n, 2: 4 * psi + 12 * psi // n, 3: 16 * psi // n}[stage]


def formula(stage: int, psi: int, n: int, width: int, coll: dict) -> int:
    """Model states plus the step's working set at its highest moment (module docstring)."""
    from megazero.zero.flat_group import FlatGroup

    g, bk, layer = 4 * width * width, coll["bucket_bytes"], 4 * (width * width + width)
    ar, rs, ag = coll["all_reduce"], coll["reduce_scatter"], coll["all_gather"]
    reduction = rs + bk // n  # R: gloo's copy of the bucket and the output shard, alive until waited for
    alive = FlatGroup.MAX_INFLIGHT if overlaps(stage) else 1  # M: reductions alive while the next bucket fills
    work = {0: max(g, ar), 1: max(g, rs + bk // n, ag), 2: max(bk + (g + alive * reduction if overlaps(2) else max(g, reduction)), ag),
            3: 2 * layer + bk + g + alive * reduction + ag}[stage]
    return model_states(stage, psi, n) + work


def sizes(args):
    """(width, layers, bucket elements, ranks, stages)."""
    if args.tiny:
        return 256, 2, 50_000, 2, [0, 3]
    return 2048, 8, 5_000_000, 4, [0, 1, 2, 3]


def case(args) -> dict:
    width, count, bucket, world, stages = sizes(args)
    psi = count * (width * width + width)
    results, rows = {}, []
    for stage in stages:
        runs = {}
        for fw in FRAMEWORKS:
            try:
                per_rank = C.run_ranks(worker, world, fw, stage, width, count, bucket, args.repeats)
                runs[fw] = {"per_rank_peak_bytes": [r["peak_bytes"] for r in per_rank],
                            "peak_bytes": [max(r["peak_bytes"][i] for r in per_rank) for i in range(args.repeats)],
                            "held_before_step_bytes": [max(r["held_before_step_bytes"][i] for r in per_rank)
                                                       for i in range(args.repeats)],
                            "held_after_step_bytes": [max(r["held_after_step_bytes"][i] for r in per_rank)
                                                      for i in range(args.repeats)],
                            "losses": [sum(r["losses"][i] for r in per_rank) / world
                                       for i in range(args.repeats + 1)],
                            "collectives_bytes": max((r["collectives_bytes"] for r in per_rank),
                                                     key=lambda c: c["reduce_scatter"] + c["all_gather"])}
            except Exception as err:  # noqa: BLE001 - a framework that cannot run is recorded
                runs[fw] = {"error": C.failure(err)}
        coll = next((r["collectives_bytes"] for r in runs.values() if "error" not in r), None)
        states = model_states(stage, psi, world)
        want = formula(stage, psi, world, width, coll) if coll else states
        res = {"formula_bytes": want, "model_states_bytes": states, "collectives_bytes": coll, "runs": {}}
        for fw, run in runs.items():
            if "error" in run:
                res["runs"][fw] = run
                continue
            res["runs"][fw] = {**run, "peak": C.spread(run["peak_bytes"], 0),
                               "peak_over_formula": C.spread([b / want for b in run["peak_bytes"]], 3)}
        mz, ds = runs.get("megazero", {}), runs.get("deepspeed", {})
        if "error" not in mz and "error" not in ds:
            res["check"] = C.check_equal("megazero vs deepspeed", mz["losses"], ds["losses"], TOL)
            res["ratio"] = C.ratio(mz["peak_bytes"], ds["peak_bytes"]) if res["check"]["ok"] else None
        results[f"zero{stage}"] = res
        rows.append(_row(stage, res, want))
    return {"model": {"layers": count, "width": width, "params": psi, "dtype": "fp32", "rows_per_rank": 1},
            "ranks": world, "bucket_elements": bucket, "measured_steps": args.repeats, "tolerance": TOL,
            "method": __doc__.split("\n\n", 1)[1].strip(), "results": results, "rows": rows}


def _row(stage: int, res: dict, want: int) -> dict:
    mib = 1 / 2 ** 20

    def cell(fw):
        run = res["runs"][fw]
        if "error" in run:
            return "failed"
        return f"{C.fmt(run['peak'], ' MiB', mib)} ({run['peak_over_formula']['median']:.2f}x formula)"

    check = res.get("check")
    errors = [f"{fw}: {r['error'].splitlines()[0][:120]}" for fw, r in res["runs"].items() if "error" in r]
    verdict = "; ".join(errors) if errors else (
        f"losses rel {check['max_rel_diff']:.1e} {'<=' if check['ok'] else '>'} {TOL:g}")
    states = res["model_states_bytes"]
    return {"case": "peak_memory", "what": f"zero{stage} peak per rank during a step; formula {want * mib:.0f} MiB "
                                           f"(model states {states * mib:.0f} MiB + working set)",
            "megazero": cell("megazero"), "peer": cell("deepspeed"), "ratio": C.fmt(res.get("ratio")),
            "check": verdict}
