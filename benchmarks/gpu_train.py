"""One-GPU training: megazero's engine vs a plain PyTorch loop of the same model. Prints one JSON object.

    python benchmarks/gpu_train.py                      # GPT-2 1.3B (24 x 2048, 16 heads), bf16, seq 2048, on cuda
    python benchmarks/gpu_train.py --device cpu --tiny  # the CPU dry run: same code, a 2-layer model, seconds

The model is megazero's `CausalLM` (SDPA attention core) built from the same seed for both contestants:
- megazero: `megazero.initialize` with a DeepSpeed-style config (bf16 working weights, fp32 master and
  gradients, megazero's fused multi-tensor Adam, ZeRO stage 0 on one rank);
- plain PyTorch: fp32 weights under `torch.autocast(bfloat16)`, `torch.optim.AdamW(fused=True)`.
Both train the same batches; the first losses must agree within bf16's tolerance (CHECK_RTOL) before a ratio
is reported. The contestants alternate in windows of steps (A/B/A/B, after warm-up) so drift hits both alike.
Step times come from CUDA events (host time on CPU). Reported per contestant: median / min / max ms per step,
tokens/s, MFU against both the datasheet's dense bf16 peak and the bf16 matmul rate measured in the same run,
and the peak memory allocated during a step (torch.cuda.max_memory_allocated, reset before it).
FLOPs per token: the model FLOPs of `megazero.core.flops.model_flops_per_token` (the trainer's and the planner's:
the GEMMs and the attention core's whole s x s square, forward + backward = 3 forwards). Peak memory of a
contestant: the most allocated during its windows, less what the other contestant holds between steps.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DATASHEET_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # dense, SXM parts (PCIe/NVL run lower)
CHECK_RTOL = 2e-2  # bf16 against fp32-weight autocast over the first steps
GPT2_XL = {"layers": 24, "hidden": 2048, "heads": 16, "vocab": 50304, "seq_len": 2048}
TINY = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32}


def clock(device):
    from megazero.runtime.clock import DeviceClock

    return DeviceClock(device)


def build(spec, device, dtype):
    from megazero.models import CausalLM
    from megazero.runtime.comm import single_rank_group

    return CausalLM(spec, single_rank_group("tp"), seed=0, device=device, dtype=dtype)


def batches(spec, micro, steps, device):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, spec.vocab, (micro, spec.seq_len + 1), generator=gen)
        yield tokens[:, :-1].to(device), tokens[:, 1:].to(device)


class Megazero:
    name = "megazero"

    def __init__(self, spec, device, lr):
        import megazero

        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                  "bf16": {"enabled": True},
                  "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
                  "zero_optimization": {"stage": 0}}
        from megazero.zero.param_groups import megatron_param_groups

        model = build(spec, device, torch.bfloat16)
        groups = megatron_param_groups(model.parameters(), weight_decay=0.1)  # no decay on 1-D, as the torch loop
        self.engine, *_ = megazero.initialize(model=model, model_parameters=groups, config=config)

    def step(self, tokens, labels) -> torch.Tensor:
        loss = self.engine(tokens, labels)[0]  # the logits are not kept through backward
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()


class PlainTorch:
    name = "torch"

    def __init__(self, spec, device, lr):
        self.model = build(spec, device, torch.float32)
        self.device = torch.device(device)
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        rest = [p for p in self.model.parameters() if p.ndim < 2]
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                     lr=lr, betas=(0.9, 0.95), **fused)

    def step(self, tokens, labels) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.model(tokens, labels)[0]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def matmul_tflops(device, n: int) -> float | None:
    """Measured dense bf16 matmul rate (n × n × n, best of 5 after warm-up), TFLOP/s; None on CPU."""
    if torch.device(device).type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            a @ b
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / 10)
    return 2 * n ** 3 / best / 1e12


def run(args) -> dict:
    from megazero.core.flops import model_flops_per_token
    from megazero.core.spec import load_spec

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    spec = load_spec("model_specs/gpt.py:debug", TINY if args.tiny else GPT2_XL)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    data = list(batches(spec, args.micro_batch, args.warmup + args.windows * args.steps, device))
    cuda = device.type == "cuda"
    contestants, losses, resident = [], {}, {}  # resident: bytes a contestant holds between its steps
    for make in (Megazero, PlainTorch):  # built and warmed up one after the other: the same first steps
        before = torch.cuda.memory_allocated() if cuda else 0
        c = make(spec, device, args.lr)
        losses[c.name] = [c.step(*data[i]).float().item() for i in range(args.warmup)]
        resident[c.name] = (torch.cuda.memory_allocated() - before) if cuda else 0
        contestants.append(c)
    n_params = sum(p.numel() for p in contestants[1].model.parameters())
    # the same computation: the first steps' losses, from the same weights and batches
    diffs = [abs(a - b) / abs(b) for a, b in zip(losses["megazero"], losses["torch"])]
    same = max(diffs) <= CHECK_RTOL

    clk = clock(device)
    times: dict[str, list[float]] = {c.name: [] for c in contestants}
    peaks: dict[str, int] = {c.name: 0 for c in contestants}
    pos = args.warmup
    for _ in range(args.windows):  # A/B/A/B: each window runs `steps` steps of each contestant
        for c in contestants:
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            for i in range(args.steps):
                start = clk.mark()
                c.step(*data[pos + i])
                end = clk.mark()
                t0, t1 = clk.resolve([start, end])
                times[c.name].append(t1 - t0)
            if cuda:  # less the other contestant's resident bytes
                others = sum(v for k, v in resident.items() if k != c.name)
                peaks[c.name] = max(peaks[c.name], torch.cuda.max_memory_allocated() - others)
        pos += args.steps

    tokens_per_step = args.micro_batch * spec.seq_len
    fpt = model_flops_per_token(spec)
    measured = matmul_tflops(device, 8192)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    datasheet = next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in name), None)
    out = {"device": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "model": {"spec": "gpt", **(TINY if args.tiny else GPT2_XL), "params": n_params},
           "micro_batch": args.micro_batch, "tokens_per_step": tokens_per_step, "flops_per_token": fpt,
           "matmul_bf16_tflops_measured": measured, "datasheet_bf16_tflops": datasheet,
           "check": {"losses": losses, "max_rel_diff": max(diffs), "rtol": CHECK_RTOL, "same": same},
           "results": {}}
    for c in contestants:
        t = times[c.name]
        med = statistics.median(t)
        tps = tokens_per_step / med
        out["results"][c.name] = {
            "step_ms": {"median": 1e3 * med, "min": 1e3 * min(t), "max": 1e3 * max(t), "n": len(t)},
            "tokens_per_s": tps,
            "mfu_datasheet": tps * fpt / (datasheet * 1e12) if datasheet else None,
            "mfu_measured_matmul": tps * fpt / (measured * 1e12) if measured else None,
            "peak_memory_bytes": peaks[c.name] if device.type == "cuda" else None}
    if same:
        ratios = [a / b for a, b in zip(times["megazero"], times["torch"])]
        out["ratio_megazero_over_torch"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    else:
        out["ratio_megazero_over_torch"] = None
        out["error"] = f"losses differ by {max(diffs):.3g} relative (> {CHECK_RTOL}); no ratio reported"
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model: the CPU dry run")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="steps per contestant before timing (>= 1: the loss check)")
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps per contestant per window")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--json", help="also write the JSON here")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (its losses are the agreement check)")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device (use --device cpu --tiny for the dry run)"}))
        return
    out = run(args)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
