"""Time overhead of each activation-checkpointing policy against none, and the activations it saves.

One process (pp = tp = dp = 1) trains the same GPT (dropout on) under each policy through
`megazero.initialize`; the engines are built once and timed round-robin (repeat r times policy 1..n,
`--steps` train_batch calls each), so drift on a shared machine affects every policy alike.
Printed JSON, per policy and clock ("wall", and "cpu": process CPU time, which a loaded machine's
preemption does not inflate; with --threads 1 it tracks the work done): seconds per step (median,
min, max, interquartile range over repeats);
the overhead against none from paired repeats (repeat r's time / none's time in the same repeat − 1:
median, min, max, IQR), robust to slow drift of the machine's load; ``best_overhead`` = min time /
min time of none − 1, robust to bursts of other load; and the peak saved-activation bytes of one
step (megazero.run.memory: kept for backward on the device and the host, recompute working set).
Expectation (docs/reference.md FLOPs): full recompute adds one forward, about 96/72 − 1 = 33% of the
step's GEMM FLOPs (more on CPU, where the recomputed element-wise ops weigh more); selective
recomputes only the attention core.

    .venv/bin/python benchmarks/checkpoint_overhead.py --repeats 15 --steps 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import megazero
from megazero.run.memory import SavedActivationMeter

POLICIES = {
    "none": {"policy": "none"},
    "full": {"policy": "full"},
    "full-every-2": {"policy": "full", "every_k_layers": 2},
    "selective": {"policy": "selective"},
    "full-partitioned-cpu": {"policy": "full", "partition_activations": True, "cpu_checkpointing": True},
    "full-contiguous": {"policy": "full", "contiguous_memory_optimization": True, "number_checkpoints": 4},
}


def build(args, ac: dict):
    cfg = {"model": {"spec": "model_specs/gpt.py:debug", "layers": args.layers, "hidden": args.hidden,
                     "heads": args.heads, "seq_len": args.seq, "vocab": 1024, "dropout": 0.1,
                     "overrides": {"attention_dropout": 0.1}},
           "train": {"micro_batch_size": args.micro_batch, "global_batch_size": args.micro_batch * args.gas,
                     "seed": 1},
           "optimizer": {"type": "adamw", "lr": 1e-4}, "activation_checkpointing": ac}
    engine, _, data, _ = megazero.initialize(config=cfg)
    return engine, data


def time_steps(engine, data, steps: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) per step."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        engine.train_batch(data)
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def spread(xs: list[float], unit: str = "_s") -> dict:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {f"median{unit}": statistics.median(xs), f"min{unit}": min(xs), f"max{unit}": max(xs),
            f"iqr{unit}": q[2] - q[0]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--gas", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--policies", default=",".join(POLICIES))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = args.policies.split(",")
    if "none" not in names:
        names.insert(0, "none")
    engines = {n: build(args, POLICIES[n]) for n in names}
    peaks = {}
    for n, (engine, data) in engines.items():
        time_steps(engine, data, 1)  # warm-up
        with SavedActivationMeter(engine.module, checkpointer=engine.module.activation_checkpointer).measure() as meter:
            engine.train_batch(data)
        peaks[n] = {"peak_saved_device_bytes": meter.peak["device"], "peak_saved_host_bytes": meter.peak["host"],
                    "peak_recompute_bytes": meter.peak["recompute"]}
    times = {(n, clock): [] for n in names for clock in ("wall", "cpu")}
    for _ in range(args.repeats):
        for n, (engine, data) in engines.items():
            wall, cpu = time_steps(engine, data, args.steps)
            times[n, "wall"].append(wall)
            times[n, "cpu"].append(cpu)
    result = {"config": vars(args), "policies": {}}
    for n in names:
        result["policies"][n] = dict(peaks[n])
        for clock in ("wall", "cpu"):
            ts, base = times[n, clock], times["none", clock]
            paired = [t / b - 1 for t, b in zip(ts, base)]
            best = min(ts) / min(base) - 1  # the least-disturbed runs of each
            result["policies"][n][clock] = spread(ts) | spread(paired, "_overhead") | {"best_overhead": best}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
