#!/usr/bin/env python
"""Check that layouts train exactly like one process.

    python tools/check_parity.py CONFIG --layouts 2x2x2 1x4x2 [--steps K] [key=value ...]
    python tools/check_parity.py --matrix pairwise|full [--list] [--limit N] [--seed S]

A layout is PPxTPxDP, counting ranks: with parallel.cp=c (context parallelism) the DP part holds the c x dp
ranks of each pipeline and tensor-parallel position (``--layouts 1x2x4 parallel.cp=2`` is dp 2, cp 2). Every layout, and the serial reference, is a `torchrun` launch of
`python -m megazero.toolbox.parity` (a user's script: `megazero.initialize`, `train_batch`) with the same
overrides, seed and global batch. The reference is always the serial run: one process, with the
options that only several ranks can use reset (sequence parallelism, pipeline schedule / chunks /
partition, ZeRO with its offload and overlap, axis order) and without activation checkpointing
(`megazero.toolbox.parity.serial_overrides`), so ``--layouts 1x4x2 parallel.sequence_parallel=true``
just works. Each layout is judged on its per-step losses, per-step gradient norms, every parameter's
first-step gradient and the final parameters, with the tolerances of `megazero.toolbox.parity`; a failure
names the quantity, the worst parameter and the step.

An Adam eps below 1e-6 is raised to 1e-6 in every run (and said): with eps = 1e-8, fp32
reduction-order noise on an element whose gradient is ~0 becomes an lr-sized update of random sign
(`megazero.toolbox.parity` explains); --keep-eps keeps the config's. Tolerances are never widened.

If the config's data.path does not exist (a fresh clone: `make demo` creates data/stdlib), the check
runs on synthetic tokens and says so.

--matrix runs the generated parity matrix (`megazero.toolbox.parity_matrix`): its all-pairs covering
set, or the full product of the allowed cases (millions: use --limit), each case against its serial
run; --list prints the cases without running them. Exit status: 0 all equal, 1 a mismatch, 2 a run
failed.
"""
from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ADAM_EPS = 1e-6  # the smallest Adam eps the parameter check is judged with (megazero.toolbox.parity)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without an install


def parse_layout(text: str) -> tuple[int, int, int]:
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"layout {text!r} must be PPxTPxDP, e.g. 2x2x2")
    return tuple(int(g) for g in m.groups())


def launch(config: str, overrides: list[str], world: int, steps: int, out: str, timeout: int) -> dict:
    """One torchrun of megazero.toolbox.parity; the merged report of its ranks."""
    import torch

    from megazero.toolbox.parity import merge_reports

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           "-m", "megazero.toolbox.parity", config, "--steps", str(steps), "--out", out] + overrides
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    reports = sorted(glob.glob(os.path.join(out, "rank*.pt")))
    if proc.returncode != 0 or len(reports) != world:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        errors = [line for line in lines if "Error" in line or "error:" in line]
        raise RuntimeError(f"exit {proc.returncode}:\n" + "\n".join((errors or lines)[-8:]))
    return merge_reports([torch.load(p, map_location="cpu", weights_only=True) for p in reports])


def layout_overrides(layout, global_batch: int) -> list[str]:
    pp, tp, _ = layout  # dp derived from the ranks: DP / cp (module docstring)
    return [f"parallel.pp={pp}", f"parallel.tp={tp}", "parallel.dp=null", f"train.global_batch_size={global_batch}",
            "train.gradient_accumulation_steps=null",
            "comm.verify_order=true"]  # every layout runs under the order check (megazero/runtime/order_check.py)


def check_config(args) -> int:
    from megazero.engine import load_run_config
    from megazero.toolbox.parity import compare, format_rows, serial_overrides

    overrides = list(args.overrides)
    cfg = load_run_config(args.config, overrides + layout_overrides(args.layouts[0], 1)[:3],
                          world_size=_world(args.layouts[0]))
    if cfg.data.path is not None and not os.path.exists(cfg.data.path + ".idx"):
        print(f"check_parity: data.path={cfg.data.path!r} does not exist (make demo creates data/stdlib); "
              f"checking on synthetic tokens (data.path=null)")
        overrides.append("data.path=null")
    if cfg.optimizer.type != "sgd" and cfg.optimizer.eps < ADAM_EPS and not args.keep_eps:
        print(f"check_parity: optimizer.eps={cfg.optimizer.eps:g} raised to {ADAM_EPS:g} in every run: Adam turns "
              f"reduction-order noise on a gradient of ~0 into lr-sized steps of random sign with a tiny eps, which "
              f"the parameter check would report (--keep-eps keeps it; gradients are checked either way)")
        overrides.append(f"optimizer.eps={ADAM_EPS}")
    global_batch = args.global_batch or cfg.train.global_batch_size
    workdir = args.workdir or tempfile.mkdtemp(prefix="megazero-parity-")
    try:
        ref = launch(args.config, overrides + serial_overrides(global_batch), 1, args.steps,
                     os.path.join(workdir, "serial"), args.timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        print(f"check_parity: the serial run failed: {err}", file=sys.stderr)
        return 2
    print(f"serial reference (global batch {global_batch}): losses {', '.join(f'{x:.6f}' for x in ref['losses'])}")
    failed = False
    for layout in args.layouts:
        name = "x".join(map(str, layout))
        try:
            res = launch(args.config, overrides + layout_overrides(layout, global_batch), _world(layout), args.steps,
                         os.path.join(workdir, name), args.timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            print(f"check_parity: layout {name} failed: {err}", file=sys.stderr)
            return 2
        rows = compare(res, ref)
        ok = all(r["ok"] for r in rows)
        failed |= not ok
        print(f"{name} vs serial: {'OK' if ok else 'FAIL'}\n{format_rows(rows)}")
    return 1 if failed else 0


def check_matrix(args) -> int:
    from megazero.toolbox import parity_matrix as pm
    from megazero.toolbox.parity import compare, format_rows, serial_key, serial_overrides

    cases = pm.pairwise_cases(pm.SEED if args.seed is None else args.seed) if args.matrix == "pairwise" else pm.full_cases()
    cases = itertools.islice(cases, args.limit) if args.limit else cases
    if args.list:
        n = 0
        for n, case in enumerate(cases, 1):
            print(pm.case_name(case))
        print(f"{n} cases")
        return 0
    workdir = args.workdir or tempfile.mkdtemp(prefix="megazero-matrix-")
    corpus = os.path.join(workdir, "stdlib")  # the real-text cases' data, written once (offline)
    refs, failures, n, start = {}, [], 0, time.monotonic()
    for n, case in enumerate(cases, 1):
        if case["data"] == "stdlib" and not os.path.exists(corpus + ".idx"):
            from megazero.data import demo_corpus, preprocess

            preprocess(lambda: demo_corpus(300_000), corpus)
        name, cfg = pm.case_name(case), pm.case_config(case, corpus)
        path = os.path.join(workdir, f"case{n}.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        gb = cfg["train"]["global_batch_size"]
        key = serial_key(cfg, gb)
        try:
            if key not in refs:
                refs[key] = launch(path, serial_overrides(gb), 1, args.steps, os.path.join(workdir, f"serial{n}"),
                                   args.timeout)
            res = launch(path, ["comm.verify_order=true"], pm.world_size(case), args.steps,
                         os.path.join(workdir, f"run{n}"), args.timeout)
            rows = compare(res, refs[key])
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            rows = [{"quantity": "run", "worst": float("inf"), "where": str(err), "tol": 0.0, "ok": False}]
        ok = all(r["ok"] for r in rows)
        print(f"[{n}] {name}: {'OK' if ok else 'FAIL'}" + ("" if ok else "\n" + format_rows(rows)), flush=True)
        if not ok:
            failures.append(name)
    print(f"{n} cases in {time.monotonic() - start:.0f} s, {len(failures)} failed" +
          "".join(f"\n  FAIL {f}" for f in failures))
    return 1 if failures else 0


def _world(layout) -> int:
    return layout[0] * layout[1] * layout[2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for every layout")
    ap.add_argument("--layouts", nargs="+", type=parse_layout)
    ap.add_argument("--matrix", choices=("pairwise", "full"))
    ap.add_argument("--list", action="store_true", help="with --matrix: print the cases, run nothing")
    ap.add_argument("--limit", type=int, default=None, help="with --matrix: the first N cases only")
    ap.add_argument("--seed", type=int, default=None, help="with --matrix pairwise: the generator's seed (default: the matrix's, megazero.toolbox.parity_matrix.SEED)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--keep-eps", action="store_true", help=f"do not raise an Adam eps below {ADAM_EPS:g}")
    ap.add_argument("--global-batch", type=int, default=None,
                    help="global batch of every layout (default: the config's, resolved for the first layout)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per launch")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_intermixed_args(argv)
    if args.matrix:
        if args.config or args.layouts:
            ap.error("--matrix builds its own configs; give no CONFIG and no --layouts")
        return check_matrix(args)
    if not args.config or not args.layouts:
        ap.error("give CONFIG and --layouts (or --matrix)")
    from megazero.core.config import ConfigError
    from megazero.core.spec import SpecError

    try:
        return check_config(args)
    except (ConfigError, SpecError) as err:
        print(f"check_parity: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
