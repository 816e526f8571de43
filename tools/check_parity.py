#!/usr/bin/env python
"""Run one config in several layouts and check that they train identically.

    python tools/check_parity.py configs/debug_gpt.yaml --layouts 1x1x1 2x2x2 2x1x4 1x2x4 4x2x1 \
        [--steps K] [--loss-rtol 1e-5] [--param-atol 1e-5] [key=value ...]

A layout is PPxTPxDP. Each layout runs `torchrun --nproc_per_node=PP*TP*DP -m megazero.run.train`
with the same overrides, the same seed and the same global batch (the gradient accumulation steps
are derived per layout), saves its final weights (by logical name, full size) and its per-step
metrics. The tool prints, for each layout against the first, the largest per-step relative loss
difference and the largest absolute final-parameter difference, and exits 1 if any exceeds the
tolerance (2 if a run fails).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

import torch


def parse_layout(text: str) -> tuple[int, int, int]:
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"layout {text!r} must be PPxTPxDP, e.g. 2x2x2")
    return tuple(int(g) for g in m.groups())


def run_layout(config: str, layout, steps: int, overrides: list[str], workdir: str, global_batch: int,
               timeout: int) -> tuple[list[float], dict]:
    pp, tp, dp = layout
    out = os.path.join(workdir, f"{pp}x{tp}x{dp}")
    args = [f"parallel.pp={pp}", f"parallel.tp={tp}", f"parallel.dp={dp}", f"train.steps={steps}",
            f"train.global_batch_size={global_batch}", "train.gradient_accumulation_steps=null",
            f"run_dir={out}", f"log.metrics_file={out}/metrics.jsonl", f"checkpoint.dir={out}/ckpt",
            f"checkpoint.save_interval={steps}", "log.progress_bar=false", f"log.interval={steps}",
            "trace.enabled=false"] + overrides
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={pp * tp * dp}",
           "-m", "megazero.run.train", config] + args
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        errors = [l for l in lines if "error:" in l or "Error" in l]
        tail = "\n".join((errors or lines)[-8:])
        raise RuntimeError(f"layout {pp}x{tp}x{dp} failed (exit {proc.returncode}):\n{tail}")
    with open(f"{out}/metrics.jsonl") as f:
        losses = [json.loads(line)["loss"] for line in f]
    params = {}
    for path in glob.glob(f"{out}/ckpt/step{steps}/model_pp*.pt"):
        params.update(torch.load(path, map_location="cpu", weights_only=True))
    return losses, params


def compare(ref, res) -> tuple[float, float]:
    (l0, p0), (l1, p1) = ref, res
    if len(l0) != len(l1):
        raise RuntimeError(f"step counts differ: {len(l0)} vs {len(l1)}")
    if set(p0) != set(p1):
        raise RuntimeError(f"parameter names differ: {sorted(set(p0) ^ set(p1))[:5]}")
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(l1, l0))
    param_diff = max((p1[k].float() - p0[k].float()).abs().max().item() for k in p0)
    return loss_diff, param_diff


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for every layout")
    ap.add_argument("--layouts", nargs="+", type=parse_layout, required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--loss-rtol", type=float, default=1e-5)
    ap.add_argument("--param-atol", type=float, default=1e-5)
    ap.add_argument("--global-batch", type=int, default=None,
                    help="global batch for every layout (default: the config's, resolved for the first layout)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per layout")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_intermixed_args(argv)
    global_batch = args.global_batch or _config_global_batch(args.config, args.overrides, args.layouts[0])
    workdir = args.workdir or tempfile.mkdtemp(prefix="megazero-parity-")
    results, failed = [], False
    for layout in args.layouts:
        try:
            results.append(run_layout(args.config, layout, args.steps, args.overrides, workdir, global_batch,
                                      args.timeout))
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            print(f"check_parity: {err}", file=sys.stderr)
            return 2
    name = "x".join(map(str, args.layouts[0]))
    print(f"reference {name}: losses {', '.join(f'{l:.6f}' for l in results[0][0])}")
    for layout, res in zip(args.layouts[1:], results[1:]):
        loss_diff, param_diff = compare(results[0], res)
        ok = loss_diff <= args.loss_rtol and param_diff <= args.param_atol
        failed |= not ok
        print(f"{'x'.join(map(str, layout)):>8} vs {name}: max loss rel diff {loss_diff:.2e} "
              f"(tol {args.loss_rtol:g}), max param abs diff {param_diff:.2e} (tol {args.param_atol:g}) "
              f"{'OK' if ok else 'FAIL'}")
    return 1 if failed else 0


def _config_global_batch(config, overrides, layout) -> int:
    from megazero.core.config import load_config

    pp, tp, dp = layout
    cfg = load_config(config, list(overrides) + [f"parallel.pp={pp}", f"parallel.tp={tp}"], world_size=pp * tp * dp)
    return cfg.train.global_batch_size


if __name__ == "__main__":
    sys.exit(main())
