"""megazero's CUDA kernels vs torch's native ops (and apex when installed): time, achieved GB/s and that as a
fraction of the device's measured copy bandwidth. Prints one JSON object.

    python benchmarks/gpu_kernels.py [--quick] [--device cuda|cpu]

Bytes are the minimum each op must move (inputs read once, outputs written once). --device cpu runs the same
code on small shapes as a smoke test (every op then runs its reference twin). Run by tools/gpu_check.sh.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megazero.runtime import kernels as K  # noqa: E402
from megazero.runtime.kernels import loader, reference  # noqa: E402


def timer(device: str, fn, iters: int, repeats: int = 5) -> float:
    """Median over `repeats` of the mean milliseconds per call of `fn` over `iters` calls."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / iters)
        else:
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - t) * 1e3 / iters)
    return statistics.median(samples)


def copy_bandwidth(device: str, nbytes: int, iters: int) -> float:
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    y = torch.empty_like(x)
    ms = timer(device, lambda: y.copy_(x), iters)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def entry(ms: float, nbytes: float, copy_gbs: float) -> dict:
    gbs = nbytes / (ms * 1e-3) / 1e9
    return {"ms": round(ms, 4), "gbs": round(gbs, 1), "fraction_of_copy_bw": round(gbs / copy_gbs, 3)}


def fwd_bwd(fn, *inputs):
    """A closure running fn forward and backward with a fixed upstream gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    grad = torch.randn_like(out)

    def run():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(grad)
    return run


def norm_cases(shape, device, dtype):
    x = torch.randn(shape, device=device, dtype=dtype)
    w, b = torch.randn(shape[-1], device=device, dtype=dtype), torch.randn(shape[-1], device=device, dtype=dtype)
    apex = loader.apex("apex.normalization.fused_layer_norm")
    ln = {"megazero": lambda a, c, d: K.layer_norm(a, c, d, 1e-5),
          "torch": lambda a, c, d: F.layer_norm(a, (shape[-1],), c, d, 1e-5)}
    rms = {"megazero": lambda a, c: K.rms_norm(a, c, 1e-5),
           "torch": lambda a, c: F.rms_norm(a, (shape[-1],), c, 1e-5)}
    if apex is not None:
        ln["apex"] = lambda a, c, d: apex.fused_layer_norm_affine(a, c, d, (shape[-1],), 1e-5)
        rms["apex"] = lambda a, c: apex.fused_rms_norm_affine(a, c, (shape[-1],), 1e-5)
    io = x.numel() * x.element_size()
    return [("layer_norm", ln, (x, w, b), 2 * io, 5 * io), ("rms_norm", rms, (x, w), 2 * io, 5 * io)]


def softmax_cases(shape, device, dtype):
    x = torch.randn(shape, device=device, dtype=dtype)
    b, _, sq, sk = shape
    mask = torch.rand(b, 1, sq, sk, device=device) < 0.1
    apex = loader.apex("apex.transformer.functional.fused_softmax")
    masked = {"megazero": lambda s: K.scaled_masked_softmax(s, mask, 0.125),
              "torch": lambda s: reference.scaled_masked_softmax(s, mask, 0.125)}
    causal = {"megazero": lambda s: K.scaled_upper_triang_masked_softmax(s, 0.125),
              "torch": lambda s: reference.scaled_upper_triang_masked_softmax(s, 0.125)}
    if apex is not None and K.softmax.backend(x, mask) != "reference":
        masked["apex"] = lambda s: apex.scaled_masked_softmax(s, mask, 0.125)
        causal["apex"] = lambda s: apex.scaled_upper_triang_masked_softmax(s, None, 0.125)
    io = x.numel() * x.element_size()
    # fwd: read x, write y; fwd+bwd adds read dy, y and write dx
    return [("scaled_masked_softmax", masked, (x,), 2 * io, 5 * io),
            ("scaled_upper_triang_masked_softmax", causal, (x,), 2 * io, 5 * io)]


def run_ops(cases, device, copy_gbs, iters) -> dict:
    out = {}
    for name, impls, inputs, fwd_bytes, fwd_bwd_bytes in cases:
        res = {}
        for impl, fn in impls.items():
            with torch.no_grad():
                fwd_ms = timer(device, lambda fn=fn: fn(*inputs), iters)
            res[impl] = {"fwd": entry(fwd_ms, fwd_bytes, copy_gbs),
                         "fwd_bwd": entry(timer(device, fwd_bwd(fn, *inputs), iters), fwd_bwd_bytes, copy_gbs)}
        for impl in list(res):
            if impl != "megazero":
                res[f"speedup_vs_{impl}"] = {k: round(res[impl][k]["ms"] / res["megazero"][k]["ms"], 3)
                                             for k in ("fwd", "fwd_bwd")}
        out[name] = res
    return out


def adam_case(device: str, total: int, copy_gbs: float, iters: int) -> dict:
    sizes = [total // 100 + (i * 7919) % 1000 for i in range(100)]  # 100 tensors of uneven sizes
    params = [torch.randn(n, device=device) for n in sizes]
    grads = [torch.randn_like(p) for p in params]
    ms, vs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    step = {"t": 0}

    def ours():
        step["t"] += 1
        K.adam_step(params, grads, ms, vs, step=step["t"], lr=1e-4, weight_decay=0.01)

    impls = {"megazero": ours}
    for kind in ("fused", "foreach"):
        if kind == "fused" and device == "cpu" and not hasattr(torch, "_fused_adamw_"):
            continue
        tp = [torch.nn.Parameter(p.clone()) for p in params]
        for p, g in zip(tp, grads):
            p.grad = g
        opt = torch.optim.AdamW(tp, lr=1e-4, weight_decay=0.01, **{kind: True})
        impls[f"torch_{kind}"] = opt.step
    try:
        from apex.optimizers import FusedAdam

        ap = [torch.nn.Parameter(p.clone()) for p in params]
        for p, g in zip(ap, grads):
            p.grad = g
        impls["apex"] = FusedAdam(ap, lr=1e-4, weight_decay=0.01, adam_w_mode=True).step
    except Exception:  # noqa: BLE001 - apex is optional
        pass
    nbytes = 28 * sum(sizes)
    res = {name: entry(timer(device, fn, iters), nbytes, copy_gbs) for name, fn in impls.items()}
    for name in list(res):
        if name != "megazero":
            res[f"speedup_vs_{name}"] = round(res[name]["ms"] / res["megazero"]["ms"], 3)
    return {"params": sum(sizes), "tensors": len(sizes), **res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="smaller shapes, fewer iterations")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"benchmark": "gpu_kernels", "skipped": "no CUDA device"}))
        return
    small = args.quick or args.device == "cpu"
    dev, dtype = args.device, torch.bfloat16
    iters = 3 if args.device == "cpu" else (10 if args.quick else 30)
    copy_gbs = copy_bandwidth(dev, (1 << 24) if args.device == "cpu" else (1 << 30), iters)
    norm_shape = (256, 1024) if small else (16384, 4096)          # (tokens, hidden)
    sm_shape = (1, 4, 128, 128) if small else (4, 32, 2048, 2048)  # (batch, heads, sq, sk)
    result = {
        "benchmark": "gpu_kernels", "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "torch": torch.__version__, "kernel_info": K.kernel_info()[dev], "copy_bandwidth_gbs": round(copy_gbs, 1),
        "dtype": str(dtype), "norm_shape": norm_shape, "softmax_shape": sm_shape,
        "ops": run_ops(norm_cases(norm_shape, dev, dtype) + softmax_cases(sm_shape, dev, dtype), dev, copy_gbs,
                       iters),
        "adam": adam_case(dev, 100_000 if small else 200_000_000, copy_gbs, iters),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
