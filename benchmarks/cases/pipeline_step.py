"""pipeline_step: megazero's pipeline schedules (gpipe, 1f1b, interleaved with 2 chunks, zb-h1) against
torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B and
ScheduleInterleavedZeroBubble, at 2 and 4 stages, 8 micro-batches, fp32.

The model is one stack of residual MLP blocks (plain nn.Modules, the same values on every rank), cut
into equal contiguous stages (virtual stages for the interleaved schedules: stage s holds virtual
stages s and s + p, as both frameworks lay them out); the loss is the mean over micro-batches of an
MSE, AdamW after each step, no clipping. megazero trains it as `PipelineModule(layers, num_stages,
loss_fn, partition_method="uniform", chunks)` + `megazero.initialize` + `engine.train_batch`; torch as
PipelineStage(s) + schedule.step + AdamW. One launch per stage count builds all eight engines in the
same rank processes and times windows of steps interleaved (megazero gpipe, torch gpipe, megazero
1f1b, ...). Step time: the slowest rank's median over a window. Check: per-step losses equal (rel 1e-4).

Bubble: the simulator's (`get_schedule` + `simulate`, unit costs, and again with the measured mean
F / B / W durations), next to megazero's measured one, 1 - (sum over stages of the time in compute
instructions) / (stages x step time), from the engine's per-instruction timings (`on_instruction`).
With plain nn.Linear layers megazero's zb-h1 B computes the input and the weight gradients together
and W only hands the held weight gradients to the optimizer (only megazero's parallel linears built
with a WeightGradStore defer their weight GEMMs to W); torch's zero-bubble schedule splits the
backward through autograd.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import _common as C
from benchmarks.cases.models import mlp_blocks, regression_batches

TOL = 1e-4
LR, WEIGHT_DECAY = 1e-3, 0.01
MICROBATCHES = 8
SCHEDULES = {  # megazero name -> (chunks, torch class name)
    "gpipe": (1, "ScheduleGPipe"), "1f1b": (1, "Schedule1F1B"), "interleaved": (2, "ScheduleInterleaved1F1B"),
    "zb-h1": (1, "ScheduleInterleavedZeroBubble"),
}


def mse(out, target):
    return F.mse_loss(out, target)


def _mz_config(p: int, schedule: str, chunks: int, rows: int) -> dict:
    return {"parallel": {"pp": p, "tp": 1}, "gradient_clipping": 0.0, "comm": {"timeout_s": 300},
            "train": {"micro_batch_size": rows, "gradient_accumulation_steps": MICROBATCHES},
            "optimizer": {"type": "adamw", "lr": LR, "weight_decay": WEIGHT_DECAY},
            "pipeline": {"schedule": schedule, "chunks": chunks}}


def build_megazero(schedule, p, blocks, width, rows, batches, records):
    """megazero's step function; `records` gets each step's {"wall", "busy", kind: seconds}."""
    import megazero
    from megazero.core import instructions as I
    from megazero.pipe import PipelineModule

    chunks = SCHEDULES[schedule][0]
    module = PipelineModule(layers=mlp_blocks(blocks, width), num_stages=p, loss_fn=mse, partition_method="uniform",
                            chunks=chunks)
    current = {}

    def on_instruction(ins, start, end):
        if not isinstance(ins, I.P2P):
            kind = type(ins).__name__
            current[kind] = current.get(kind, 0.0) + (end - start)
            current[kind + "_n"] = current.get(kind + "_n", 0) + 1

    engine, *_ = megazero.initialize(model=module, config=_mz_config(p, schedule, chunks, rows),
                                     on_instruction=on_instruction)
    it = iter(batches)

    def step():
        x, y = next(it)
        micro = list(zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)))
        current.clear()
        start = time.perf_counter()
        loss = engine.train_batch(iter(micro))
        wall = time.perf_counter() - start
        busy = sum(v for k, v in current.items() if not k.endswith("_n"))
        records.append({"wall": wall, "busy": busy, **current})
        return loss
    return step


def build_torch(schedule, p, blocks, width, batches, losses_out):
    """torch.distributed.pipelining's step function (losses_out: each step's mean micro-batch loss,
    on the last stage)."""
    import torch.distributed as dist
    from torch.distributed import pipelining as pp

    chunks, cls_name = SCHEDULES[schedule]
    rank = dist.get_rank()
    layers = mlp_blocks(blocks, width)
    per = blocks // (p * chunks)
    stage_ids = [rank + c * p for c in range(chunks)]  # loop layout: stage s holds virtual stages s, s + p
    stages = [pp.PipelineStage(nn.Sequential(*layers[v * per:(v + 1) * per]), v, p * chunks, torch.device("cpu"))
              for v in stage_ids]
    cls = getattr(pp, cls_name)
    sched = cls(stages if issubclass(cls, pp.schedules.PipelineScheduleMulti) else stages[0], MICROBATCHES,
                loss_fn=mse)
    params = [q for s in stages for q in s.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    first, last = 0 in stage_ids, p * chunks - 1 in stage_ids
    it = iter(batches)

    def step():
        x, y = next(it)
        opt.zero_grad(set_to_none=True)
        losses = []
        args = (x,) if first else ()
        sched.step(*args, target=y if last else None, losses=losses if last else None)
        opt.step()
        loss = float(torch.stack(losses).detach().mean()) if last else float("nan")
        losses_out.append(loss)
        return loss
    return step


def worker(p, blocks, width, rows, warmup, repeats, window):
    import torch.distributed as dist

    steps = warmup + repeats * window
    batches = regression_batches(rows * MICROBATCHES, width, steps)
    contestants, absent, records, torch_losses = {}, {}, {}, {}
    for schedule in SCHEDULES:
        for who in ("megazero", "torch"):
            name = f"{who}:{schedule}"
            try:
                if who == "megazero":
                    records[schedule] = []
                    contestants[name] = build_megazero(schedule, p, blocks, width, rows, batches, records[schedule])
                else:
                    torch_losses[schedule] = []
                    contestants[name] = build_torch(schedule, p, blocks, width, batches, torch_losses[schedule])
            except Exception as err:  # noqa: BLE001 - recorded, the others run
                absent[name] = C.failure(err)
            dist.barrier()
    timed = C.interleaved_windows(contestants, warmup, repeats, window, sync=dist.barrier)
    return {"timed": timed, "absent": absent, "records": {k: v[warmup:] for k, v in records.items()},
            "torch_losses": torch_losses, "rank": dist.get_rank()}


def simulated_bubbles(schedule: str, p: int, per_rank: list[dict]) -> dict:
    from megazero.core.schedules import get_schedule
    from megazero.core.simulate import Costs, simulate

    chunks = SCHEDULES[schedule][0]
    programs = get_schedule(schedule, p, MICROBATCHES, chunks)
    out = {"unit_costs": round(simulate(programs, Costs()).bubble_fraction, 4)}
    recs = [rec for r in per_rank for rec in r["records"].get(schedule, [])]

    def mean(kind):
        total, n = sum(r.get(kind, 0.0) for r in recs), sum(r.get(kind + "_n", 0) for r in recs)
        return total / n if n else 0.0
    if recs:
        f, b, bi, w = mean("Forward"), mean("Backward"), mean("BackwardInput"), mean("BackwardWeight")
        costs = Costs(forward=f, backward_input=bi if bi else b / 2, backward_weight=w if bi else b / 2)
        out["measured_costs"] = round(simulate(programs, costs).bubble_fraction, 4)
        out["measured_costs_used_s"] = {"forward": round(f, 6), "backward": round(b, 6),
                                        "backward_input": round(bi, 6), "backward_weight": round(w, 6)}
    return out


def measured_bubble(schedule: str, p: int, per_rank: list[dict]) -> dict | None:
    """1 - sum_s busy_s / (p x step time) per timed step (step time: the slowest rank's)."""
    recs = [r["records"].get(schedule) for r in per_rank]
    if not all(recs):
        return None
    values = []
    for i in range(len(recs[0])):
        wall = max(r[i]["wall"] for r in recs)
        values.append(1 - sum(r[i]["busy"] for r in recs) / (p * wall))
    return C.spread(values)


def measure(p: int, blocks: int, width: int, rows: int, warmup: int, repeats: int, window: int) -> dict:
    try:
        per_rank = C.run_ranks(worker, p, p, blocks, width, rows, warmup, repeats, window)
    except Exception as err:  # noqa: BLE001
        return {"error": C.failure(err)}
    absent = per_rank[0]["absent"]
    timed = [r["timed"] for r in per_rank]
    out = {"stages": p, "absent": absent, "schedules": {}}
    for schedule, (chunks, torch_cls) in SCHEDULES.items():
        ours, theirs = f"megazero:{schedule}", f"torch:{schedule}"
        res = {"chunks": chunks, "torch_schedule": torch_cls, "bubble_simulated": simulated_bubbles(schedule, p, per_rank),
               "bubble_measured_megazero": None}
        if ours in absent:
            res["error"] = "megazero: " + absent[ours]
            out["schedules"][schedule] = res
            continue
        res["step_s"] = {"megazero": C.spread(C.slowest_rank(timed, ours))}
        res["bubble_measured_megazero"] = measured_bubble(schedule, p, per_rank)
        if theirs in absent:
            res["peer_absent"] = absent[theirs]
        else:
            res["step_s"]["torch"] = C.spread(C.slowest_rank(timed, theirs))
            mz = timed[0][ours]["warmup_losses"] + timed[0][ours]["losses"]
            last = per_rank[-1]["torch_losses"][schedule]  # the last stage's rank holds torch's losses
            res["check"] = C.check_equal(f"megazero {schedule} vs torch {torch_cls}", mz, last, TOL)
            res["ratio"] = (C.ratio(C.slowest_rank(timed, ours), C.slowest_rank(timed, theirs))
                            if res["check"]["ok"] else None)
        out["schedules"][schedule] = res
    return out


def sizes(args):
    """(blocks, width, rows per micro-batch, warm-up, steps per window, stage counts)."""
    if args.tiny:
        return 8, 16, 2, 1, 1, [2]
    return 16, 256, 32, 2, 2, [2, 4]


def rows(results: dict) -> list[dict]:
    out = []
    for key, res in results.items():
        if "error" in res:
            out.append({"case": "pipeline_step", "what": key, "check": "failed: " + res["error"].splitlines()[0][:160]})
            continue
        for schedule, r in res["schedules"].items():
            sim, meas = r["bubble_simulated"], r.get("bubble_measured_megazero")
            bubble = (f"bubble: simulated {sim['unit_costs']:.3f} (unit costs), "
                      f"{sim.get('measured_costs', float('nan')):.3f} (measured costs); megazero measured {C.fmt(meas)}")
            check = r.get("check")
            verdict = (r.get("error") or r.get("peer_absent") or
                       f"losses rel {check['max_rel_diff']:.1e} {'<=' if check['ok'] else '>'} {TOL:g}")
            out.append({"case": "pipeline_step", "what": f"{key} {schedule} vs {r['torch_schedule']}, {MICROBATCHES} micro-batches, step; {bubble}",
                        "megazero": C.fmt(r.get("step_s", {}).get("megazero"), " s"),
                        "peer": C.fmt(r.get("step_s", {}).get("torch"), " s") if "peer_absent" not in r else "absent",
                        "ratio": C.fmt(r.get("ratio")), "check": verdict.splitlines()[0][:200]})
    return out


def case(args) -> dict:
    blocks, width, rows_per_mb, warmup, window, stage_counts = sizes(args)
    results = {f"pp{p}": measure(p, blocks, width, rows_per_mb, warmup, args.repeats, window) for p in stage_counts}
    return {"model": {"blocks": blocks, "width": width, "params": blocks * (8 * width * width + 7 * width),
                      "block": "x + Linear(4w->w)(gelu(Linear(w->4w)(LayerNorm(x))))", "loss": "MSE", "dtype": "fp32"},
            "micro_batches": MICROBATCHES, "rows_per_micro_batch": rows_per_mb, "warmup_steps": warmup,
            "steps_per_window": window, "repeats": args.repeats, "tolerance": TOL,
            "method": __doc__.split("\n\n", 1)[1].strip(), "results": results, "rows": rows(results)}
