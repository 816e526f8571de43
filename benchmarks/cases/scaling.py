"""scaling: megazero ZeRO-1 weak scaling: the zero_step GPT with a fixed micro-batch per rank at 1, 2,
4 and 8 ranks: step time, tokens/s and efficiency (tokens/s at N over N x tokens/s at 1 rank).

THIS MACHINE'S CORES ARE SHARED: every rank gets max(1, cores // ranks) torch threads, so on 2 cores
4 and 8 ranks time-share the same 2 cores and cannot scale; the figures show the framework's
overhead under that sharing, not a cluster's scaling.

Method: one launch per world size; in it megazero and "single" (one process training plain PyTorch
on the same global batch with all the cores, run by rank 0 while the others wait) are timed in
interleaved windows after warm-up (zero_step's worker). Efficiency pairs the windows of N ranks
with those of 1 rank by repeat. Check: megazero's losses (rank mean) equal the single process's
(rel 1e-4); a world size whose check fails reports no figures.
"""
from __future__ import annotations

import sys

from benchmarks import _common as C
from benchmarks.cases import zero_step
from benchmarks.cases.models import GPTSize

TOL = 1e-4


def sizes(args):
    """(model, micro-batch per rank, warm-up, steps per window, world sizes)."""
    if args.tiny:
        return GPTSize(layers=1, hidden=32, heads=2, vocab=64, seq=16), 1, 1, 1, [1, 2]
    return GPTSize(), 2, 2, 2, [1, 2, 4, 8]


def measure(world: int, size: GPTSize, micro: int, warmup: int, repeats: int, window: int) -> dict:
    print(f"[bench] scaling: {world} ranks", file=sys.stderr, flush=True)
    tokens = micro * world * size.seq
    res = {"ranks": world, "threads_per_rank": C.threads_per_rank(world), "tokens_per_step": tokens,
           "shares_cores": world > C.threads_per_rank(1)}
    try:
        per_rank = C.run_ranks(zero_step.worker, world, ["megazero", "single"], size, zero_step.SETTINGS["zero1"],
                               micro, warmup, repeats, window)
    except Exception as err:  # noqa: BLE001
        return {**res, "error": C.failure(err)}
    timed = [r["timed"] for r in per_rank]
    if per_rank[0]["absent"]:
        return {**res, "error": "; ".join(f"{k}: {v}" for k, v in per_rank[0]["absent"].items())}
    res["check"] = C.check_equal(f"megazero {world} ranks vs one process", zero_step.step_losses(timed, "megazero"),
                                 zero_step.step_losses(timed, "single"), TOL)
    if res["check"]["ok"]:
        ours, single = C.slowest_rank(timed, "megazero"), C.slowest_rank(timed, "single")
        res["window_step_s"] = ours
        res["step_s"] = C.spread(ours)
        res["tokens_per_s"] = C.spread([tokens / s for s in ours], 1)
        res["single_step_s"] = C.spread(single)
        res["megazero/single"] = C.ratio(ours, single)
    return res


def case(args) -> dict:
    size, micro, warmup, window, worlds = sizes(args)
    cores = C.threads_per_rank(1)
    results, rows = {}, []
    base = None
    for world in worlds:
        res = measure(world, size, micro, warmup, args.repeats, window)
        if "window_step_s" in res:
            tps = [res["tokens_per_step"] / s for s in res["window_step_s"]]
            base = tps if world == worlds[0] else base
            if base:
                res["efficiency_vs_1_rank"] = C.spread([t / (world * b) for t, b in zip(tps, base)], 3)
        results[f"ranks{world}"] = res
        rows.append(_row(res, micro, size, cores))
    return {"model": {**size.__dict__, "params": size.params()}, "zero_stage": 1, "micro_batch_per_rank": micro,
            "cores": cores, "warning": f"{max(worlds)} ranks share {cores} cores: no scaling is possible beyond "
                                       f"{cores} ranks on this machine",
            "method": __doc__.split("\n\n", 1)[1].strip(), "results": results, "rows": rows,
            "notes": [f"ranks beyond {cores} share this machine's {cores} cores (max(1, cores // ranks) threads each)"]}


def _row(res: dict, micro: int, size: GPTSize, cores: int) -> dict:
    world = res["ranks"]
    share = f"{world} ranks SHARE {cores} cores" if world > cores else f"{world} ranks on {cores} cores"
    row = {"case": "scaling", "what": f"zero1 weak scaling, {micro}x{size.seq} tokens per rank, {share}; "
                                      f"peer: one process, same global batch"}
    if "error" in res:
        return {**row, "check": "failed: " + res["error"].splitlines()[0][:160]}
    check = res["check"]
    return {**row, "megazero": f"{C.fmt(res.get('step_s'), ' s')}, {C.fmt(res.get('tokens_per_s'), ' tok/s')}, "
                               f"efficiency {C.fmt(res.get('efficiency_vs_1_rank'))}",
            "peer": C.fmt(res.get("single_step_s"), " s"), "ratio": C.fmt(res.get("megazero/single")),
            "check": f"losses rel {check['max_rel_diff']:.1e} {'<=' if check['ok'] else '>'} {TOL:g}"}
