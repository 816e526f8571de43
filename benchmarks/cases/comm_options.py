"""comm_options: what each communication option of issue 19 saves and costs, against its baseline, in
one launch of 8 ranks emulating 2 nodes x 4 (``parallel.ranks_per_node=4``) on megazero's debug GPT:

- ``comm.hierarchical`` against flat ZeRO-1;
- 1-bit Adam past its warm-up (``optimizer.type=onebit_adam``, ``freeze_step`` = the warm-up steps)
  against AdamW, both at ZeRO-0;
- ZeRO++'s ``zero.quantized_weights`` (qwZ), ``zero.hpz_partition_size=4`` (hpZ, one node) and
  ``zero.quantized_gradients`` (qgZ) against plain ZeRO-3.

Method: every contestant is built on every rank, warmed up, then timed in interleaved windows (A/B/A/B);
per window the slowest rank's median step. Bytes per step are counted by megazero's CommStats over the
timed steps: what the mean rank sends over the data-parallel groups (dp, its two levels, hpz) and what
all ranks together send across the emulated nodes. Check before a ratio: the option's per-step losses
against its baseline's, within 1e-6 (hierarchical: another summation order; hpZ: exact) or 2% (the
lossy ones: 1-bit, int8). THIS MACHINE'S 2 CORES ARE SHARED by the 8 ranks and its "nodes" share one
memory: times show each option's compute overhead (packing, quantizing, extra passes), not a network's
saving; the bytes are what a cluster would move.
"""
from __future__ import annotations

import sys

from benchmarks import _common as C

BASE = {"model": {"spec": "model_specs/gpt.py:debug"}, "train": {"micro_batch_size": 1, "global_batch_size": 16},
        "optimizer": {"type": "adamw", "lr": 1e-3}, "parallel": {"ranks_per_node": 4},
        "zero": {"reduce_bucket_size": 100_000, "param_persistence_threshold": 0}}
PAIRS = {  # option -> (baseline, the option's config changes, the baseline's, loss tolerance)
    "hierarchical": ("flat", {"comm": {"hierarchical": True}}, {"zero": {"stage": 1}}, 1e-6),
    "onebit_adam": ("adamw", {"optimizer": {"type": "onebit_adam"}}, {"zero": {"stage": 0}}, 0.02),
    "qwZ": ("zero3", {"zero": {"quantized_weights": True}}, {"zero": {"stage": 3}}, 0.02),
    "hpZ": ("zero3", {"zero": {"hpz_partition_size": 4}}, {"zero": {"stage": 3}}, 0.0),
    "qgZ": ("zero3", {"zero": {"quantized_gradients": True}}, {"zero": {"stage": 3}}, 0.02),
}
AXES = ("dp", "dp.intra", "dp.inter", "hpz")


def _merge(base: dict, *changes: dict) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for ch in changes:
        for k, v in ch.items():
            out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


def configs(warmup: int) -> dict:
    """name -> config of every contestant (baselines once)."""
    out = {}
    for option, (baseline, mine, theirs, _) in PAIRS.items():
        out[baseline] = _merge(BASE, theirs)
        out[option] = _merge(BASE, theirs, mine)
    out["onebit_adam"]["optimizer"]["freeze_step"] = warmup  # compressed from the first timed step
    return out


def worker(cfgs: dict, warmup: int, repeats: int, window: int):
    """On each rank: build every contestant, time them interleaved; the bytes each sent over its
    data-parallel groups and across nodes during the timed steps."""
    import torch.distributed as dist

    import megazero

    steps, engines, absent = {}, {}, {}
    for name, cfg in cfgs.items():
        try:
            engine, _, data, _ = megazero.initialize(config=cfg)
            engines[name] = engine
            steps[name] = (lambda e=engine, d=data: e.train_batch(d))
        except Exception as err:  # noqa: BLE001 - a contestant that cannot run is recorded
            absent[name] = C.failure(err)
        dist.barrier()
    before = {}

    def timed_step(name, step):
        def run():
            if name not in before:  # the first timed step: the warm-up's bytes are left out
                stats = engines[name].pctx.stats
                before[name] = (sum(stats.total(axis=a).bytes for a in AXES),
                                sum(stats.total(axis=a, inter_node=True).bytes for a in AXES))
            return step()
        return run

    warm = {n: s for n, s in steps.items()}
    for name, step in warm.items():
        for _ in range(warmup):
            step()
    timed = C.interleaved_windows({n: timed_step(n, s) for n, s in steps.items()}, 0, repeats, window,
                                  sync=dist.barrier)
    moved = {}
    for name, engine in engines.items():
        stats = engine.pctx.stats
        total = (sum(stats.total(axis=a).bytes for a in AXES), sum(stats.total(axis=a, inter_node=True).bytes for a in AXES))
        moved[name] = [(t - b) / (repeats * window) for t, b in zip(total, before[name])]
    return {"timed": timed, "absent": absent, "moved": moved}


def sizes(args):
    """(warm-up steps, steps per window)."""
    return (2, 1) if args.tiny else (6, 3)


def case(args) -> dict:
    warmup, window = sizes(args)
    cfgs = configs(warmup)
    print(f"[bench] comm_options: {', '.join(cfgs)} at 8 ranks", file=sys.stderr, flush=True)
    per_rank = C.run_ranks(worker, 8, cfgs, warmup, args.repeats, window, timeout=1800)
    absent = per_rank[0]["absent"]
    timed = [r["timed"] for r in per_rank]
    results, rows = {}, []
    for option, (baseline, _, _, tol) in PAIRS.items():
        if option in absent or baseline in absent:
            results[option] = {"error": absent.get(option) or absent.get(baseline)}
            rows.append({"case": "comm_options", "what": option, "check": f"failed: {results[option]['error']}"})
            continue
        losses = [[r[name]["losses"] for r in timed] for name in (option, baseline)]
        mean = [[sum(col) / len(col) for col in zip(*per)] for per in losses]  # each step's rank mean
        check = C.check_equal(f"{option} vs {baseline}", mean[0], mean[1], tol)
        ours, theirs = C.slowest_rank(timed, option), C.slowest_rank(timed, baseline)
        dp_bytes = [sum(r["moved"][name][0] for r in per_rank) / len(per_rank) for name in (option, baseline)]
        crossed = [sum(r["moved"][name][1] for r in per_rank) for name in (option, baseline)]
        res = {"baseline": baseline, "check": check, "dp_bytes_per_step_per_rank": dp_bytes,
               "internode_bytes_per_step": crossed}
        if check["ok"]:
            res.update({"step_s": C.spread(ours), "baseline_step_s": C.spread(theirs),
                        "option/baseline": C.ratio(ours, theirs),
                        "dp_bytes_ratio": round(dp_bytes[0] / dp_bytes[1], 4) if dp_bytes[1] else None,
                        "internode_bytes_ratio": round(crossed[0] / crossed[1], 4) if crossed[1] else None})
        results[option] = res
        rows.append({"case": "comm_options", "what": f"{option} vs {baseline}: step; dp bytes/rank; across nodes",
                     "megazero": f"{C.fmt(res.get('step_s'), ' s')}; {dp_bytes[0] / 1e6:.3g} MB; {crossed[0] / 1e6:.3g} MB",
                     "peer": f"{C.fmt(res.get('baseline_step_s'), ' s')}; {dp_bytes[1] / 1e6:.3g} MB; "
                             f"{crossed[1] / 1e6:.3g} MB",
                     "ratio": (f"{C.fmt(res.get('option/baseline'))}; {res.get('dp_bytes_ratio')}; "
                               f"{res.get('internode_bytes_ratio')}") if check["ok"] else "-",
                     "check": f"losses {check['max_rel_diff']:.2g} (tol {tol:g}) {'ok' if check['ok'] else 'FAILED'}"})
    return {"ranks": 8, "ranks_per_node": 4, "method": __doc__.split("\n\n", 1)[1].strip(), "results": results,
            "rows": rows, "notes": ["8 ranks share 2 cores and one memory: times are overhead, bytes are the saving"]}
