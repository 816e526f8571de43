"""Layout parity: train one config in a layout and compare it with the serial run of the same config.

    torchrun --nproc_per_node=N -m megazero.toolbox.parity CONFIG --steps K --out DIR [key=value ...]

`run_layout(config, overrides, steps)` runs on every rank of a layout (as a user's script does:
`megazero.initialize`, then `engine.train_batch`) and returns this rank's `report`: the per-step losses
(agreed over the layout), the per-step global gradient norms (before clipping), every parameter's
reduced gradient of the first step (loss scale removed, before clipping) and the final parameters,
both by logical name at full size, from the ranks with dp rank 0 and tp rank 0 of each stage.
`merge_reports` joins the ranks' reports; `compare` judges one against the serial reference.

The reference is always the serial run (`serial_overrides`): one process, the same model, data,
seed, precision, micro-batch size and global batch (gradient accumulation = micro-batches per rank x
dp), with what only several ranks can use reset (sequence parallelism, the pipeline schedule, chunks
and partition, ZeRO: stage 0, no offload, no overlap, no ZeRO++; the axis order; ranks per node,
hierarchical collectives, the order check) and without activation
checkpointing (recomputation must not change a number, so the plain run is the reference).

Dropout: the ranks of a layout draw different masks than one process does (Megatron's TP streams), so
a run with dropout installs `LogicalMaskFn` masks keyed by (site, global micro-batch), the same in
every layout (`megazero.tensor_parallel.random`).

Tolerances (`TOLERANCES`; the closing tolerances of issue 12):

- fp32: losses 1e-5 relative, gradient norms 1e-5 relative (1e-6 at step 1, `STEP1_NORM_RTOL`: before any
  update the norm differs between layouts only by the order its fp64-accumulated parts are summed and
  the fp32 gradients' own reduction order), each first-step gradient tensor within
  1e-5 x its largest |g|, final parameters 1e-5 absolute. Adam divides by sqrt(v) + eps: on an
  element whose gradient is ~0, fp32 reduction-order noise of ~1e-9 becomes an update of
  lr x noise / eps, 2e-5 after five steps with eps = 1e-8 (seen on one element of
  embedding.position.weight at tp=4 with sequence parallelism). The matrix therefore runs eps = 1e-6
  (noise x 1e-3 / 1e-6 = 1e-6 per step), and gradients are the primary per-element check; the
  tolerances are not widened.
- bf16 / fp16 (against the serial run in the same precision): a layout changes where 16-bit
  roundings happen (TP partial sums are rounded before their all-reduce, the serial GEMM after the
  whole sum; sequence-parallel and pipeline boundaries add none, reductions over dp are fp32). Each
  such rounding moves a value by at most u = 2^-8 (bf16) or 2^-11 (fp16) relative; a loss or a norm
  is an average over all tokens of errors of either sign, within a few u; a gradient element sums
  per-token terms each carrying a few u relative error of its own magnitude, so its error is within
  a few u of the tensor's largest |g|. Stated: losses and norms 4u relative, gradients 16u x max|g|
  (the sums run over 8 layers, each adding its own rounding to the backward), parameters
  2 x lr x steps absolute beyond u x |p| (Adam moves an element by ~lr per step whatever its gradient's
  size, so an element whose gradient is within rounding of 0 may move either way; the fp32 masters
  are rounded to the 16-bit working weights compared here, half an ulp, u x |p|, each side).

Gradient scale: a tensor's largest |g| is floored at `GRAD_FLOOR` (1e-3) of the model's largest. A
tensor whose exact gradient is zero holds rounding noise only, relative to which any layout differs
by 100%: the attention key bias (softmax ignores a shift shared by all keys, so d loss / d b_k = 0).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys

import torch

from megazero.core.launch_env import read_launch_env

UNIT_ROUNDOFF = {"fp32": 0.0, "bf16": 2 ** -8, "fp16": 2 ** -11}  # of the working parameters compared
GRAD_FLOOR = 1e-3  # a tensor's gradient scale is at least this fraction of the model's largest |g|
# (loss rtol, grad-norm rtol, first-step gradient tol x max|g|, parameter atol or None = 2·lr·steps)
STEP1_NORM_RTOL = 1e-6  # fp32: the first step's gradient norm (the optimizer accumulates it in fp64)
TOLERANCES = {"fp32": (1e-5, 1e-5, 1e-5, 1e-5),
              "bf16": (4 * 2 ** -8, 4 * 2 ** -8, 16 * 2 ** -8, None),
              "fp16": (4 * 2 ** -11, 4 * 2 ** -11, 16 * 2 ** -11, None)}


def serial_overrides(global_batch: int) -> list[str]:
    """Overrides (applied after the user's) that make any config its serial reference."""
    return ["parallel.pp=1", "parallel.tp=1", "parallel.dp=1", "parallel.cp=1", "parallel.cp_method=ring",
            "parallel.ep=1", "parallel.expert_tp=null",
            "parallel.sequence_parallel=false",
            "parallel.order=[pp,dp,tp]", "pipeline.schedule=1f1b", "pipeline.chunks=1", "pipeline.partition=uniform",
            "activation_checkpointing.policy=none", "activation_checkpointing.every_k_layers=1",
            "activation_checkpointing.number_checkpoints=null", "activation_checkpointing.partition_activations=false",
            "activation_checkpointing.cpu_checkpointing=false",
            "activation_checkpointing.contiguous_memory_optimization=false",
            "activation_checkpointing.synchronize_checkpoint_boundary=false", "activation_checkpointing.profile=false",
            "zero.stage=0", "zero.offload_optimizer.device=none", "zero.offload_param.device=none",
            "zero.overlap_comm=false", f"train.global_batch_size={global_batch}",
            "train.gradient_accumulation_steps=null",
            # options of several ranks only: nodes, two-level collectives, ZeRO++ (stage 3's), the order check
            "parallel.ranks_per_node=null", "comm.hierarchical=false", "comm.verify_order=false",
            "zero.quantized_weights=false", "zero.hpz_partition_size=1", "zero.quantized_gradients=false"]


def serial_key(config, global_batch: int) -> str:
    """A text equal for two configs exactly when their serial references are equal (their resolved
    serial configs), so runs can share one."""
    from megazero.core.config import to_dict
    from megazero.engine import load_run_config

    cfg = load_run_config(config, serial_overrides(global_batch), world_size=1)
    return json.dumps(to_dict(cfg), sort_keys=True, default=str)


@contextlib.contextmanager
def _first_step_gradients(optimizer, tp_group, out: dict):
    """Within the block, the optimizer's first step first stores every reduced gradient (full size,
    by logical name) in `out`; all-gathers over the dp group (stages 1-3) and the TP group."""
    from megazero.tensor_parallel import gather_full_tensors

    real_step = optimizer.step

    def step():
        optimizer.step = real_step
        out.update({k: v.float() for k, v in gather_full_tensors(optimizer.reduced_gradients(), tp_group).items()})
        return real_step()
    optimizer.step = step
    try:
        yield
    finally:
        optimizer.step = real_step


def run_layout(config, overrides=(), steps: int = 2) -> dict:
    """Train `steps` steps in this process group's layout; this rank's report (module docstring)."""
    import megazero
    from megazero.moe.experts import gather_expert_tensors
    from megazero.tensor_parallel import Dropout, LogicalMaskFn, gather_full_params, set_dropout_mask_fn

    engine, optimizer, data, _ = megazero.initialize(config=config, overrides=list(overrides))
    pctx = engine.pctx
    rates = {m.p for m in engine.module.modules() if isinstance(m, Dropout) and m.p > 0}
    if rates:
        set_dropout_mask_fn(engine.module, LogicalMaskFn(7, max(rates), pctx.dp_rank, pctx.dp_size,
                                                         engine.num_microbatches))
    losses, norms, grads = [], [], {}
    with _first_step_gradients(optimizer, pctx.tp_group, grads):
        for _ in range(steps):
            losses.append(engine.train_batch(data))
            norms.append(engine.get_global_grad_norm())
    with optimizer.full_parameters():
        params = {k: v.float() for k, v in gather_full_params(engine.module, pctx.tp_group).items()}
    grads = gather_expert_tensors(grads, engine.module, pctx.ep_group)  # MoE: every expert, not this rank's
    params = gather_expert_tensors(params, engine.module, pctx.ep_group)
    reporter = pctx.dp_rank == 0 and pctx.tp_rank == 0 and pctx.cp_rank == 0
    from megazero.runtime import comm

    comm.barrier(pctx.world_group)  # no rank leaves (rank 0 hosts the store) while others still communicate
    return {"losses": losses, "norms": norms, "grads": grads if reporter else {},
            "params": params if reporter else {}, "lr": optimizer.param_groups[0]["lr"],
            "precision": str(next(engine.module.parameters()).dtype).replace("torch.", "")}


def merge_reports(reports: list[dict]) -> dict:
    """One report of a layout: rank 0's losses and norms, every stage's gradients and parameters."""
    out = dict(reports[0], grads={}, params={})
    for r in reports:
        out["grads"].update(r["grads"])
        out["params"].update(r["params"])
    return out


_PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def compare(result: dict, reference: dict, steps: int | None = None) -> list[dict]:
    """Every quantity of `result` against `reference` (the serial run): one row per quantity with
    its worst value, where it is (parameter and/or step), the tolerance and whether it holds."""
    precision = _PRECISION[reference["precision"]]
    loss_rtol, norm_rtol, grad_tol, param_atol = TOLERANCES[precision]
    steps = steps or len(reference["losses"])
    if param_atol is None:
        param_atol = 2 * reference["lr"] * steps
    rows = []

    def row(quantity, worst, where, tol):
        ok = math.isfinite(worst) and worst <= tol
        rows.append({"quantity": quantity, "worst": worst, "where": where, "tol": tol, "ok": ok})

    if len(result["losses"]) != len(reference["losses"]):
        raise ValueError(f"{len(result['losses'])} steps vs {len(reference['losses'])} in the reference")
    rel = [(abs(a - b) / abs(b) if b else abs(a), i) for i, (a, b) in enumerate(zip(result["losses"], reference["losses"]))]
    worst, i = max(rel)
    row("loss", worst, f"step {i + 1}", loss_rtol)
    rel = [(abs(a - b) / abs(b) if b else abs(a), i) for i, (a, b) in enumerate(zip(result["norms"], reference["norms"]))
           if a is not None and b is not None]
    if rel:
        worst, i = max(rel)
        row("grad norm", worst, f"step {i + 1}", norm_rtol)
        if precision == "fp32" and rel[0][1] == 0:  # before any update, one scalar summed in fp64: 1e-6
            row("grad norm at step 1", rel[0][0], "step 1", STEP1_NORM_RTOL)
    u = UNIT_ROUNDOFF[precision]
    floor = GRAD_FLOOR * max((g.abs().max().item() for g in reference["grads"].values()), default=0.0)
    for quantity, key in (("first-step gradient / max|g|", "grads"), ("final parameter", "params")):
        mine, ref = result[key], reference[key]
        if set(mine) != set(ref):
            missing = sorted(set(mine) ^ set(ref))
            rows.append({"quantity": quantity, "worst": math.inf, "where": f"names differ: {missing[:4]}",
                         "tol": 0.0, "ok": False})
            continue
        worst, where = 0.0, "-"
        for name in sorted(ref):
            if key == "grads":  # relative to the tensor's largest |g| (floored: see the module docstring)
                diff = (mine[name] - ref[name]).abs().max().item() / max(ref[name].abs().max().item(), floor, 1e-30)
            else:  # absolute, less the half-ulp each side of a 16-bit working copy (0 in fp32)
                diff = ((mine[name] - ref[name]).abs() - u * ref[name].abs()).max().item()
            if not math.isfinite(diff) or diff > worst:
                worst, where = diff, name
            if not math.isfinite(diff):
                break
        row(quantity, worst, where if key == "grads" else f"{where} after step {steps}",
            grad_tol if key == "grads" else param_atol)
    return rows


def format_rows(rows: list[dict]) -> str:
    return "\n".join(f"  {'ok  ' if r['ok'] else 'FAIL'} {r['quantity']:<30} {r['worst']:.2e} (tol {r['tol']:.1e}) "
                     f"at {r['where']}" for r in rows)


def main(argv=None) -> int:
    """torchrun entry: run_layout on every rank, each rank's report saved to OUT/rank<r>.pt."""
    ap = argparse.ArgumentParser(prog="python -m megazero.toolbox.parity", description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_intermixed_args(argv)
    report = run_layout(args.config, args.overrides, args.steps)
    os.makedirs(args.out, exist_ok=True)
    torch.save(report, os.path.join(args.out, f"rank{read_launch_env(os.environ).rank}.pt"))
    sys.stdout.flush()
    os._exit(0)  # torch 2.13 + gloo can abort at interpreter exit after the report is written


if __name__ == "__main__":
    sys.exit(main())
