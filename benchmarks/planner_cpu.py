"""The calibrated planner against megazero's measured steps on this machine (issue 33, item 3).

    python benchmarks/planner_cpu.py [--layouts N] [--rounds R] [--steps K] [--only NAME ...] --json OUT.json

R rounds (default 5), each:
1. ``plan.py --calibrate`` on 1, 2, 4 and 8 ranks (`megazero.toolbox.calibrate`): the hardware file each layout's
   rank count plans with (8 ranks share the 2 cores here; the probe measures what one rank gets when they do),
   measured again each round, as the machine's speed drifts over minutes.
2. A generated set of layouts of the debug GPT and Llama (`layouts()`: every pp x tp x dp factorisation of
   1, 2, 4 and 8 ranks, each with a ZeRO stage, schedule, recompute policy, precision and micro-batch drawn
   by a seeded generator under the trainer's own rules), in an order shuffled per round, each started once the
   cores are idle.
3. Each layout runs on its ranks (gloo): warm-up steps, then K timed steps (a barrier before and after each;
   the round's step time is their median; the CPU time of each rank's process, gloo's threads included),
   then one step under `LiveTensorBytes`, the peak of every tensor storage alive on the rank during the step
   (parameters, gradients, optimizer states, buffers, activations and temporaries; the CPU's
   `max_memory_allocated`), per pipeline stage the largest of its ranks.
4. The planner's prediction from the round's calibrated files: `predict_step(...).step_time_s` and, per stage,
   every byte `predict_memory(device="cpu")` counts before its fragmentation allowance (host and device: one
   memory on a CPU).

A layout's measured step is the median over the rounds (the spread: the rounds' min-max), its predicted step
the median of the rounds' predictions; error = predicted / measured - 1. Writes OUT.json (the hardware files,
every layout's measured and predicted figures) and OUT.md (the table docs/planning.md shows). Nothing here asserts on
wall-clock times.
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _common as C  # noqa: E402

GPT = {"spec": "model_specs/gpt.py:debug", "layers": 4, "hidden": 256, "heads": 8, "vocab": 512, "seq_len": 128}
LLAMA = {"spec": "model_specs/llama.py:debug", "layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4,
         "ffn_hidden": 512, "vocab": 512, "seq_len": 128}


def layouts(count: int = 24, seed: int = 33) -> list[dict]:
    """`count` layouts: first every (pp, tp, dp) with pp, tp in 1, 2, 4 and pp·tp·dp in 1, 2, 4, 8, then
    more drawn; each gets a drawn model, ZeRO stage, schedule (for pp > 1), recompute policy, precision and
    micro-batch, kept when the trainer's config validation accepts it."""
    from megazero.core.spec import SpecError
    from megazero.engine import load_run_config

    rng = random.Random(seed)
    grids = [(pp, tp, world // (pp * tp)) for world in (1, 2, 4, 8) for pp in (1, 2, 4) for tp in (1, 2, 4)
             if world % (pp * tp) == 0]
    out, names = [], set()
    attempts = 0
    while len(out) < count and attempts < 10_000:
        attempts += 1
        pp, tp, dp = grids[len(out)] if len(out) < len(grids) else rng.choice(grids)
        model = dict(rng.choice([GPT, LLAMA]))
        zero = rng.choice([0, 1, 2, 3])
        schedule = rng.choice(["1f1b", "gpipe", "interleaved", "zb-h1"]) if pp > 1 else "1f1b"
        chunks = 2 if schedule == "interleaved" else 1
        if pp * chunks > 4:
            model["layers"] = pp * chunks
        recompute = rng.choice(["none", "selective", "full"])
        precision = "fp32"  # a CPU trains in fp32 (the probe times fp32 GEMMs)
        micro = rng.choice([1, 2, 4])
        m = rng.choice([2, 4]) * pp
        cfg = {"model": model, "precision": precision,
               "parallel": {"pp": pp, "tp": tp, "sequence_parallel": tp > 1 and rng.random() < 0.5},
               "pipeline": {"schedule": schedule, "chunks": chunks},
               "train": {"micro_batch_size": micro, "global_batch_size": micro * m * dp, "seed": 5, "steps": 100},
               "zero": {"stage": zero, "overlap_comm": rng.random() < 0.5},
               "activation_checkpointing": {"policy": recompute},
               "optimizer": {"type": "adamw", "lr": 1e-4}}
        try:
            load_run_config(cfg, world_size=pp * tp * dp)
        except (ValueError, SpecError):  # the trainer's pre-launch check refuses it
            continue
        name = (f"{model['spec'].split('/')[-1].split('.')[0]}-pp{pp}-tp{tp}-dp{dp}-z{zero}-{recompute}-"
                f"{schedule}-{precision}-mb{micro}x{m}" + ("-sp" if cfg["parallel"]["sequence_parallel"] else ""))
        if name in names:
            continue
        names.add(name)
        out.append({"name": name, "world": pp * tp * dp, "config": cfg})
    return out


def _seconds_stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _cpu_seconds() -> float:
    """CPU time this process used so far (user + system, every thread: torch's and gloo's)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def wait_until_idle(max_wait_s: float = 20.0, busy: float = 0.1) -> None:
    """Before a layout starts: wait (up to `max_wait_s`) until the machine's cores were less than `busy` used over
    half a second (the previous layout's ranks exiting, or another program, would otherwise slow its steps)."""
    def ticks():
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # all, idle + iowait
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        total0, idle0 = ticks()
        time.sleep(0.5)
        total1, idle1 = ticks()
        if total1 == total0 or 1 - (idle1 - idle0) / (total1 - total0) < busy:
            return


def layout_worker(config: dict, warmup: int, steps: int) -> dict:
    """On each rank: warm-up steps, `steps` timed steps (barriers around each), one step under
    `LiveTensorBytes`; {"pp": stage, "times": [s], "peak_bytes": int}."""
    import torch.distributed as dist

    import megazero
    from megazero.run.memory import LiveTensorBytes, SavedActivationMeter, memory_report

    engine, opt, data, _ = megazero.initialize(config=config)
    for _ in range(warmup):
        engine.train_batch(data)
    times, cpu = [], []
    for _ in range(steps):
        dist.barrier()
        start, used = time.perf_counter(), _cpu_seconds()
        engine.train_batch(data)
        dist.barrier()
        times.append(time.perf_counter() - start)
        cpu.append(_cpu_seconds() - used)
    ckpt = engine.module.activation_checkpointer
    meter = SavedActivationMeter(engine.module, checkpointer=ckpt)
    with LiveTensorBytes() as live:
        start = live.total
        with meter.measure():
            engine.train_batch(data)
        end = live.current()
    report = {k: v for k, v in memory_report(opt, meter, ckpt).items() if v}
    return {"pp": engine.pctx.pp_rank, "times": times, "cpu": cpu, "peak_bytes": live.peak, "start_bytes": start,
            "end_bytes": end, "report": report}


def calibrate(world: int, out_dir: Path, alone: dict | None = None) -> Path:
    """Run the probe on `world` ranks (`alone`: the one-rank figures, `calibrate.probe_alone`, when already
    measured this round); the hardware file's path."""
    from megazero.toolbox import calibrate as cal

    path = out_dir / f"cpu-{world}-ranks.yaml"
    cal.write(str(path), cal.probe(world, name=f"this CPU, {world} ranks (gloo)", alone=alone), world)
    return path


def predict(config: dict, world: int, hardware_path: Path) -> dict:
    """{"step_s", "stage_bytes": [per stage]} predicted for `config` on the calibrated `hardware_path`."""
    from megazero.engine import load_run_config
    from megazero.planner.from_config import layout_of, spec_of
    from megazero.planner.hardware import load_hardware
    from megazero.planner.memory_plan import predict_memory
    from megazero.planner.speed import predict_step

    cfg = load_run_config(config, world_size=world)
    layout, _ = layout_of(cfg)
    spec = spec_of(cfg)
    hw = load_hardware(str(hardware_path), str(C.ROOT / "configs" / "hardware"))
    step = predict_step(spec, layout, hw)  # the file's measured efficiency replaces the defaults (Machine)
    mem = predict_memory(spec, layout, device="cpu", param_persistence_threshold=cfg.zero.param_persistence_threshold)
    stage_bytes = [sum(st.breakdown.values()) + sum(st.transient.values()) - st.counted_twice for st in mem.stages]
    parts = [{k: v for k, v in {**st.breakdown, **st.transient}.items() if v} for st in mem.stages]
    return {"step_s": step.step_time_s, "stage_bytes": stage_bytes, "stage_parts": parts,
            "breakdown": {k: round(v, 5) for k, v in step.breakdown.items() if v}}


def markdown(rows: list[dict]) -> str:
    """The table of `rows` (main's layouts) that docs/planning.md shows."""
    lines = ["| layout | ranks | measured step (s, median of rounds; min-max) | CPU s per rank | predicted (min-max) "
             "| error | measured peak (MB, the stage furthest off) | predicted | error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        st, pr = r["step_s"], r.get("predicted_spread") or {"min": r["predicted_step_s"], "max": r["predicted_step_s"]}
        m = min(r["memory"], key=lambda x: -abs(x["error"]))
        cpu = f"{r['cpu_s']:.3f}" if r.get("cpu_s") is not None else "-"
        lines.append(f"| {r['name']} | {r['world']} | {st['median']:.3f} ({st['min']:.3f}-{st['max']:.3f}) | {cpu} "
                     f"| {r['predicted_step_s']:.3f} ({pr['min']:.3f}-{pr['max']:.3f}) | {r['time_error']:+.0%} "
                     f"| {m['measured'] / 1e6:.2f} (stage {m['stage']}) | {m['predicted'] / 1e6:.2f} | {m['error']:+.1%} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", type=int, default=24)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="passes over the layouts (the step time: their medians' median)")
    ap.add_argument("--only", nargs="*", default=None, help="layout names (substrings) to run")
    ap.add_argument("--hardware-dir", default=None, help="reuse the calibrated files here")
    ap.add_argument("--json", default="runs/planner_cpu.json")
    ap.add_argument("--predict-only", default=None, metavar="MEASURED.json",
                    help="take the measurements from this earlier output and predict again, from its rounds' "
                         "hardware files (or those in --hardware-dir)")
    args = ap.parse_args(argv)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    hw_dir = Path(args.hardware_dir) if args.hardware_dir else out.parent / "planner_cpu_hardware"
    hw_dir.mkdir(parents=True, exist_ok=True)
    todo = [lay for lay in layouts(args.layouts) if not args.only or any(s in lay["name"] for s in args.only)]
    worlds = sorted({lay["world"] for lay in todo})

    def hardware_files(round_: int) -> dict:
        """{ranks: hardware file}: those in --hardware-dir (calibrated there if absent), else calibrated now,
        before this round's measurements (the machine's speed drifts by several percent over minutes)."""
        if args.hardware_dir or args.predict_only:
            return {w: hw_dir / f"cpu-{w}-ranks.yaml" if (hw_dir / f"cpu-{w}-ranks.yaml").exists()
                    else calibrate(w, hw_dir) for w in worlds}
        from megazero.toolbox.calibrate import probe_alone

        here = hw_dir / f"round{round_ + 1}"
        here.mkdir(parents=True, exist_ok=True)
        alone = probe_alone()  # host time per operator and the step's compute over its kernels': one per round
        return {w: calibrate(w, here, alone) for w in worlds}

    before = json.loads(Path(args.predict_only).read_text()) if args.predict_only else {}
    earlier = {r["name"]: r for r in before.get("layouts", [])}
    runs = {lay["name"]: [] for lay in todo}
    files_per_round = []
    if before.get("hardware_rounds") and not args.hardware_dir:  # predict again from the rounds' own files
        files_per_round = [{int(w): Path(p) for w, p in files.items()} for files in before["hardware_rounds"]]
    for round_ in range(0 if files_per_round else 1 if args.predict_only else args.rounds):  # interleaved
        wait_until_idle()
        files_per_round.append(hardware_files(round_))
        order = [] if args.predict_only else list(todo)
        random.Random(round_).shuffle(order)  # each round in its own order: no layout always follows the same one
        for lay in order:
            wait_until_idle()
            runs[lay["name"]].append(C.run_ranks(layout_worker, lay["world"], lay["config"], args.warmup, args.steps))
            times = runs[lay["name"]][-1][0]["times"]
            print(f"round {round_ + 1}/{args.rounds} {lay['name']}: "
                  f"{statistics.median(times) if times else float('nan'):.3f} s", flush=True)
    rows = []
    for lay in todo:
        if args.predict_only:
            old = earlier[lay["name"]]
            step, cpu = old["step_s"], old.get("cpu_s")
            measured = {m["stage"]: m["measured"] for m in old["memory"]}
            reports = {m["stage"]: m["report"] for m in old["memory"]}
        else:
            rounds = runs[lay["name"]]
            if args.steps:
                step = _seconds_stats([statistics.median(ranks[0]["times"]) for ranks in rounds])
                cpu = statistics.median(statistics.median(r["cpu"]) for ranks in rounds for r in ranks)
            else:  # memory only
                step, cpu = {"median": float("nan"), "min": 0, "max": 0, "n": 0}, None
            step["steps_per_round"] = args.steps
            measured, reports = {}, {}
            for r in rounds[0]:  # the peak is the same every round (the table shows round 1's)
                if r["peak_bytes"] >= measured.get(r["pp"], 0):
                    measured[r["pp"]] = r["peak_bytes"]
                    reports[r["pp"]] = {"start": r["start_bytes"], "end": r["end_bytes"], **r["report"]}
        preds = [predict(lay["config"], lay["world"], files[lay["world"]]) for files in files_per_round]
        pred = preds[0]  # memory: the same from every file (exact byte counts)
        predicted = _seconds_stats([p["step_s"] for p in preds])
        mem = [{"stage": s, "measured": measured[s], "predicted": pred["stage_bytes"][s], "report": reports[s],
                "predicted_parts": pred["stage_parts"][s],
                "error": pred["stage_bytes"][s] / measured[s] - 1} for s in sorted(measured)]
        row = {"name": lay["name"], "world": lay["world"], "step_s": step, "cpu_s": cpu,
               "predicted_step_s": predicted["median"], "predicted_spread": predicted,
               "time_error": predicted["median"] / step["median"] - 1, "memory": mem,
               "memory_error": max((m["error"] for m in mem), key=abs), "breakdown": pred["breakdown"]}
        rows.append(row)
        print(f"{row['name']:60s} step {step['median']:.3f} s ({step['min']:.3f}-{step['max']:.3f}) "
              f"predicted {predicted['median']:.3f} ({predicted['min']:.3f}-{predicted['max']:.3f}, "
              f"{row['time_error']:+.1%}); memory error {row['memory_error']:+.1%}", flush=True)
    files = files_per_round[0]
    result = {"machine": C.machine_info(), "hardware": {w: str(p) for w, p in files.items()},
              "hardware_rounds": [{w: str(p) for w, p in f.items()} for f in files_per_round], "layouts": rows}
    out.write_text(json.dumps(result, indent=1, default=str))
    out.with_suffix(".md").write_text(markdown(rows))
    return result


if __name__ == "__main__":
    main()
