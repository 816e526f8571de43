"""CPU Adam throughput: megazero's SIMD kernel vs torch's AdamW (foreach, fused), DeepSpeedCPUAdam (if
importable), and the machine's streaming-bandwidth limit measured in the same run. Prints one JSON object.

    python benchmarks/cpu_adam.py [--params 50000000] [--tensors 100] [--layout both|single|many]
                                  [--rounds 7] [--steps 4]

Layouts (same total --params): "single", one flat fp32 parameter per optimizer (as a ZeRO-Offload shard); and
"many", --tensors parameters of --params / --tensors elements each (100 x 500K: a model's parameters, or the
runs of a ZeRO shard that differ in lr / weight decay). megazero steps the many layout with ONE list call
(per-tensor lr and weight decay), and, for comparison, with one single-tensor kernel call per tensor (the
_per_tensor_calls row); the peers step their 100 parameters as optimizers do. fp32 grads, torch's thread count
for everyone. Each round times every implementation of a layout (--steps steps, each timed; the best counts)
and then probes the bandwidth limit: the best of STREAM copy, in-place add and triad (benchmarks/stream.c
compiled here with -O3 -march=native -fopenmp and loaded with ctypes; best of 3 repetitions) at 28 bytes per
parameter (Adam reads p, g, m, v and writes p, m, v in fp32). Interleaving puts a neighbour's load on all of them
alike; ratios are taken within a round and reported as median / min / max over rounds. The +bf16_copy rows add
the 16-bit working-weight copy mixed-precision training needs (megazero: same pass; torch: a copy after the step).
Layouts run one after the other (each with its own probes); the single layout's report is the top level of the
JSON (its fields as before), the many layout's is under "many_tensors".
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
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
    """megazero.runtime.kernels.adam_step on a list of flat fp32 tensors in one call (the call ZeRO-Offload
    makes), with per-tensor lr and weight decay; per_tensor_calls steps them with one kernel call each."""

    def __init__(self, sizes: list[int], copy_dtype: torch.dtype | None = None, per_tensor_calls: bool = False):
        self.p, self.g = [torch.randn(n) for n in sizes], [torch.randn(n) for n in sizes]
        self.m, self.v = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
        self.copy = None if copy_dtype is None else [torch.empty(n, dtype=copy_dtype) for n in sizes]
        self.lr, self.wd = [HYPER["lr"]] * len(sizes), [HYPER["weight_decay"]] * len(sizes)
        self.per_tensor_calls = per_tensor_calls
        self.t = 0
        self.backend = ""

    def step(self):
        self.t += 1
        hyper = dict(step=self.t, beta1=HYPER["betas"][0], beta2=HYPER["betas"][1], eps=HYPER["eps"],
                     adamw_mode=True)
        if not self.per_tensor_calls:
            self.backend = adam_step(self.p, self.g, self.m, self.v, lr=self.lr, weight_decay=self.wd,
                                     param_copy=self.copy, **hyper)
            return
        for i in range(len(self.p)):
            self.backend = adam_step(self.p[i], self.g[i], self.m[i], self.v[i], lr=self.lr[i],
                                     weight_decay=self.wd[i], param_copy=None if self.copy is None else self.copy[i],
                                     **hyper)


class TorchOptim:
    """A torch.optim (or DeepSpeed) optimizer on parameters of the given sizes; with copy_dtype, followed by the
    copy into 16-bit working weights that megazero's kernel writes in the same pass."""

    def __init__(self, sizes: list[int], make, copy_dtype: torch.dtype | None = None):
        self.params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
        for p in self.params:
            p.grad = torch.randn(p.numel())
        self.opt = make(self.params)
        self.copy = None if copy_dtype is None else [torch.empty(n, dtype=copy_dtype) for n in sizes]

    def step(self):
        self.opt.step()
        if self.copy is not None:
            with torch.no_grad():
                torch._foreach_copy_(self.copy, self.params)


def deepspeed_factory():
    """DeepSpeedCPUAdam's factory and "importable", else None and why. DeepSpeed logs to stdout, which carries
    the JSON here: its import and constructor write to stderr instead."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as err:  # noqa: BLE001 - optional peer: any import problem means absent
        return None, f"not importable ({type(err).__name__})"

    def make(ps):
        with contextlib.redirect_stdout(sys.stderr):
            return DeepSpeedCPUAdam(ps, adamw_mode=True, **HYPER)

    return make, "importable"


def implementations(sizes: list[int]) -> tuple[dict, dict]:
    """name -> (factory, bytes per param), and notes on peers that are absent."""
    def fused(ps):
        return torch.optim.AdamW(ps, fused=True, **HYPER)

    impls = {
        "megazero_cpu_adam": (lambda: Megazero(sizes), BYTES_PER_PARAM),
        "megazero_cpu_adam+bf16_copy": (lambda: Megazero(sizes, torch.bfloat16), BYTES_PER_PARAM + 2),
    }
    if len(sizes) > 1:
        impls["megazero_cpu_adam_per_tensor_calls"] = (lambda: Megazero(sizes, per_tensor_calls=True),
                                                       BYTES_PER_PARAM)
    impls |= {
        "torch_adamw_foreach": (lambda: TorchOptim(sizes, lambda ps: torch.optim.AdamW(ps, foreach=True, **HYPER)),
                                BYTES_PER_PARAM),
        "torch_adamw_fused": (lambda: TorchOptim(sizes, fused), BYTES_PER_PARAM),
        "torch_adamw_fused+bf16_copy": (lambda: TorchOptim(sizes, fused, torch.bfloat16), BYTES_PER_PARAM + 2),
    }
    notes = {}
    ds, status = deepspeed_factory()
    if ds is not None:
        impls["deepspeed_cpu_adam"] = (lambda: TorchOptim(sizes, ds), BYTES_PER_PARAM)
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


def measure(sizes: list[int], rounds: int, steps: int, stream: Stream) -> dict:
    impls, notes = implementations(sizes)
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
    backend = objs["megazero_cpu_adam"].backend
    return dict(backend=backend, secs=secs, streams=streams, bytes={k: b for k, (_, b) in impls.items()},
                notes=notes)


def report(sizes: list[int], m: dict, threads: int, load_before: tuple) -> dict:
    n = sum(sizes)
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
    for peer in (k for k in m["secs"] if not k.startswith("megazero_cpu_adam+") and k != "megazero_cpu_adam"):
        ours = "megazero_cpu_adam+bf16_copy" if peer.endswith("+bf16_copy") else "megazero_cpu_adam"
        ratios[f"{ours}_vs_{peer}"] = spread([p / o for o, p in zip(m["secs"][ours], m["secs"][peer])])
    kernels = ("copy_gbs", "add_gbs", "triad_gbs", "best_gbs")
    peers = [k for k in ratios if "per_tensor_calls" not in k]
    out = {"benchmark": "cpu_adam", "params": n}
    if len(sizes) > 1:
        out |= {"tensors": len(sizes), "params_per_tensor": sizes[0]}
    limit_ms = [n / pps * 1e3 for pps in limit_pps]
    return out | {
        "bytes_per_param": BYTES_PER_PARAM,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch_threads": threads, "torch": torch.__version__, "isa": m["backend"]},
        "contention": {"loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                       "note": "cores shared with other jobs; rounds interleave implementations and probes"},
        "limit_gbs": {k: spread([s[k] for s in m["streams"]], 1) for k in kernels},
        "limit_params_per_s_M": spread([x / 1e6 for x in limit_pps], 1),
        "limit_step_ms": spread(limit_ms, 2),
        "results": results, "ratios": ratios,
        "peers_absent": {k: v for k, v in m["notes"].items() if v != "importable"},
        "goal": {"faster_than_every_peer_median": all(ratios[k]["median"] > 1 for k in peers),
                 "fraction_of_limit_median": results["megazero_cpu_adam"]["fraction_of_limit"]["median"],
                 "target_fraction": 0.9},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=50_000_000, help="elements per layout (all tensors together)")
    ap.add_argument("--tensors", type=int, default=100, help="tensors of the many layout")
    ap.add_argument("--layout", choices=("both", "single", "many"), default="both")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    if args.tensors < 2 or args.params % args.tensors:
        ap.error(f"--tensors={args.tensors}: expected at least 2 tensors dividing --params={args.params}")
    if loader.cpu_adam() is None:
        sys.exit("benchmarks/cpu_adam.py: the megazero CPU Adam kernel is not available (see the line above)")
    layouts = {"single": [args.params], "many": [args.params // args.tensors] * args.tensors}
    wanted = ("single", "many") if args.layout == "both" else (args.layout,)
    threads = torch.get_num_threads()
    reports = {}
    with tempfile.TemporaryDirectory() as tmp:
        stream = Stream(Path(tmp), args.params, threads)
        try:
            for name in wanted:  # one layout at a time: its optimizers' memory is freed before the next
                load_before = os.getloadavg()
                m = measure(layouts[name], args.rounds, args.steps, stream)
                reports[name] = report(layouts[name], m, threads, load_before)
                del m
                gc.collect()
        finally:
            stream.close()
    out = reports.get("single", {"benchmark": "cpu_adam"})
    if "many" in reports:
        out["many_tensors"] = reports["many"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
