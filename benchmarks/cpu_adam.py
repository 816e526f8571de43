"""CPU Adam throughput: megazero's SIMD kernel vs torch's AdamW (foreach, fused), DeepSpeedCPUAdam (if
importable), and the machine's streaming-bandwidth limit measured in the same run. Prints one JSON object.

    python benchmarks/cpu_adam.py [--params 50000000] [--rounds 7] [--steps 4]

Method: one flat fp32 parameter of --params elements per optimizer (as a ZeRO-Offload shard), fp32 grads,
torch's thread count for everyone. Each round times every implementation (--steps steps, each timed; the best
counts) and then probes the bandwidth limit: the best of STREAM copy, in-place add and triad (benchmarks/stream.c
compiled here with -O3 -march=native -fopenmp and loaded with ctypes; best of 3 repetitions) at 28 bytes per
parameter (Adam reads p, g, m, v and writes p, m, v in fp32). Interleaving puts a neighbour's load on all of them
alike; ratios are taken within a round and reported as median / min / max over rounds. The +bf16_copy rows add
the 16-bit working-weight copy mixed-precision training needs (megazero: same pass; torch: a copy_ after the step).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megazero.runtime.kernels import adam_step, loader  # noqa: E402

BYTES_PER_PARAM = 28
HERE = Path(__file__).resolve().parent
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


class Stream:
    """benchmarks/stream.c as a shared library: arrays allocated once, probed between Adam rounds."""

    def __init__(self, out_dir: Path, n: int, threads: int):
        lib = out_dir / "libstream.so"
        cmd = [os.environ.get("CC", "cc"), "-O3", "-march=native", "-fopenmp", "-fno-tree-loop-distribute-patterns",
               "-shared", "-fPIC", "-DSTREAM_LIBRARY", str(HERE / "stream.c"), "-o", str(lib)]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        self.lib = ctypes.CDLL(str(lib))
        self.lib.stream_init.argtypes = [ctypes.c_long]
        self.lib.stream_measure.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
        if self.lib.stream_init(n) != 0:
            raise MemoryError(f"stream.c could not allocate 3 x {n} floats")
        self.threads = threads

    def measure(self, reps: int = 3) -> dict:
        out = (ctypes.c_double * 3)()
        self.lib.stream_measure(reps, self.threads, out)
        gbs = dict(zip(("copy_gbs", "add_gbs", "triad_gbs"), (round(x, 2) for x in out)))
        return {**gbs, "best_gbs": max(gbs.values())}

    def close(self):
        self.lib.stream_free()


class Megazero:
    """megazero.runtime.kernels.adam_step on the flat shard (the call ZeRO-Offload makes)."""

    def __init__(self, n: int, copy_dtype: torch.dtype | None = None):
        self.p, self.g = torch.randn(n), torch.randn(n)
        self.m, self.v = torch.zeros(n), torch.zeros(n)
        self.copy = None if copy_dtype is None else torch.empty(n, dtype=copy_dtype)
        self.t = 0
        self.backend = ""

    def step(self):
        self.t += 1
        self.backend = adam_step(self.p, self.g, self.m, self.v, step=self.t, lr=HYPER["lr"],
                                 beta1=HYPER["betas"][0], beta2=HYPER["betas"][1], eps=HYPER["eps"],
                                 weight_decay=HYPER["weight_decay"], adamw_mode=True, param_copy=self.copy)


class TorchOptim:
    """A torch.optim (or DeepSpeed) optimizer on one parameter of n elements; with copy_dtype, followed by the
    copy into 16-bit working weights that megazero's kernel writes in the same pass."""

    def __init__(self, n: int, make, copy_dtype: torch.dtype | None = None):
        self.p = torch.nn.Parameter(torch.randn(n))
        self.p.grad = torch.randn(n)
        self.opt = make([self.p])
        self.copy = None if copy_dtype is None else torch.empty(n, dtype=copy_dtype)

    def step(self):
        self.opt.step()
        if self.copy is not None:
            self.copy.copy_(self.p.detach())


def deepspeed_factory():
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as err:  # noqa: BLE001 - optional peer: any import problem means absent
        return None, f"not importable ({type(err).__name__})"
    return (lambda ps: DeepSpeedCPUAdam(ps, adamw_mode=True, **HYPER)), "importable"


def implementations(n: int) -> tuple[dict, dict]:
    """name -> (factory, bytes per param), and notes on peers that are absent."""
    impls = {
        "megazero_cpu_adam": (lambda: Megazero(n), BYTES_PER_PARAM),
        "megazero_cpu_adam+bf16_copy": (lambda: Megazero(n, torch.bfloat16), BYTES_PER_PARAM + 2),
        "torch_adamw_foreach": (lambda: TorchOptim(n, lambda ps: torch.optim.AdamW(ps, foreach=True, **HYPER)),
                                BYTES_PER_PARAM),
        "torch_adamw_fused": (lambda: TorchOptim(n, lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER)),
                              BYTES_PER_PARAM),
        "torch_adamw_fused+bf16_copy": (lambda: TorchOptim(n, lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER),
                                                           torch.bfloat16), BYTES_PER_PARAM + 2),
    }
    notes = {}
    ds, status = deepspeed_factory()
    if ds is not None:
        impls["deepspeed_cpu_adam"] = (lambda: TorchOptim(n, ds), BYTES_PER_PARAM)
    notes["deepspeed_cpu_adam"] = status
    return impls, notes


def best_step(obj, steps: int) -> float:
    """Seconds of the fastest of `steps` steps."""
    best = float("inf")
    for _ in range(steps):
        start = time.perf_counter()
        obj.step()
        best = min(best, time.perf_counter() - start)
    return best


def spread(values: list[float], digits: int = 3) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def measure(n: int, rounds: int, steps: int, stream: Stream) -> dict:
    impls, notes = implementations(n)
    objs = {name: make() for name, (make, _) in impls.items()}
    for obj in objs.values():  # warm-up: first touch of optimizer state, thread pools
        for _ in range(2):
            obj.step()
    secs = {name: [] for name in objs}
    streams = []
    for _ in range(rounds):
        for name, obj in objs.items():
            secs[name].append(best_step(obj, steps))
        streams.append(stream.measure())
    return dict(objs=objs, secs=secs, streams=streams, bytes={k: b for k, (_, b) in impls.items()}, notes=notes)


def report(n: int, m: dict, threads: int, load_before: tuple) -> dict:
    limit_pps = [s["best_gbs"] * 1e9 / BYTES_PER_PARAM for s in m["streams"]]  # per round
    results = {}
    for name, secs in m["secs"].items():
        pps = [n / s for s in secs]
        results[name] = {"params_per_s_M": spread([x / 1e6 for x in pps], 1),
                         "step_ms": spread([s * 1e3 for s in secs], 2),
                         "gbs": spread([x * m["bytes"][name] / 1e9 for x in pps], 1),
                         "fraction_of_limit": spread([x / lim for x, lim in zip(pps, limit_pps)]),
                         "fraction_of_best_limit": round(statistics.median(pps) / max(limit_pps), 3)}
    ratios = {}
    for peer in (k for k in m["secs"] if not k.startswith("megazero")):
        ours = "megazero_cpu_adam+bf16_copy" if peer.endswith("+bf16_copy") else "megazero_cpu_adam"
        ratios[f"{ours}_vs_{peer}"] = spread([p / o for o, p in zip(m["secs"][ours], m["secs"][peer])])
    kernels = ("copy_gbs", "add_gbs", "triad_gbs", "best_gbs")
    return {
        "benchmark": "cpu_adam", "params": n, "bytes_per_param": BYTES_PER_PARAM,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch_threads": threads, "torch": torch.__version__,
                    "isa": m["objs"]["megazero_cpu_adam"].backend},
        "contention": {"loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                       "note": "cores shared with other jobs; rounds interleave implementations and probes"},
        "limit_gbs": {k: spread([s[k] for s in m["streams"]], 1) for k in kernels},
        "limit_params_per_s_M": spread([x / 1e6 for x in limit_pps], 1),
        "results": results, "ratios": ratios,
        "peers_absent": {k: v for k, v in m["notes"].items() if v != "importable"},
        "goal": {"faster_than_every_peer_median": all(r["median"] > 1 for r in ratios.values()),
                 "fraction_of_limit_median": results["megazero_cpu_adam"]["fraction_of_limit"]["median"],
                 "target_fraction": 0.9},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=50_000_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    if loader.cpu_adam() is None:
        sys.exit("benchmarks/cpu_adam.py: the megazero CPU Adam kernel is not available (see the line above)")
    threads = torch.get_num_threads()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        stream = Stream(Path(tmp), args.params, threads)
        try:
            m = measure(args.params, args.rounds, args.steps, stream)
        finally:
            stream.close()
    print(json.dumps(report(args.params, m, threads, load_before), indent=1))


if __name__ == "__main__":
    main()
