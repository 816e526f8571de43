"""Shared worker for layout-parity tests: train a config on the ranks of `run_ranks` and report
per-step losses, grad norms, and this rank's full parameters by logical name.

Every layout of the same config (same seed, same global batch) must give the single-process
numbers: `compare` checks per-step losses (relative), grad norms (relative) and final parameters
(absolute; the debug models' parameters are O(0.02-1))."""

import megazero
from megazero.tensor_parallel import gather_full_grads, gather_full_params


def train_worker(config: dict, steps: int, overrides=()):
    engine, optimizer, data, _ = megazero.initialize(config=config, overrides=list(overrides))
    losses, norms = [], []
    for _ in range(steps):
        losses.append(engine.train_batch(data))
        norms.append(engine.last_info.get("grad_norm"))
    pctx = engine.pctx
    with optimizer.full_parameters():
        params = gather_full_params(engine.module, pctx.tp_group)
    params = {k: v.float() for k, v in params.items()} if pctx.dp_rank == 0 and pctx.tp_rank == 0 else {}
    return losses, norms, params


def steps_and_params(engine, optimizer, data, steps: int):
    """Train `steps` steps: (losses, grad norms, every full parameter by logical name as numpy, gathered
    over dp at stage 3 and over TP: every rank gets them)."""
    losses, norms = [], []
    for _ in range(steps):
        losses.append(engine.train_batch(data))
        norms.append(engine.get_global_grad_norm())
    with optimizer.full_parameters():
        params = {k: v.float().numpy() for k, v in gather_full_params(engine.module, engine.pctx.tp_group).items()}
    return losses, norms, params


def grad_worker(config: dict, overrides=()):
    """One step's loss (on this rank) and the reduced gradients gathered to full shape by logical
    name (this rank's stage; dp rank 0, tp rank 0 report). Needs zero.stage 0 or 1."""
    engine, optimizer, data, _ = megazero.initialize(config=config, overrides=list(overrides))
    captured = {}

    def capture():
        optimizer.reduce_grads()
        for p, g in optimizer.reduced_gradients().items():
            p.grad = g.clone()
        captured.update(gather_full_grads(engine.module, engine.pctx.tp_group))
        for p in engine.module.parameters():
            p.grad = None
        return {"skipped": False}
    optimizer.step = capture
    loss = engine.train_batch(data)
    pctx = engine.pctx
    return loss, ({k: v.float() for k, v in captured.items()} if pctx.dp_rank == 0 and pctx.tp_rank == 0 else {})


def merge(results):
    """(losses, norms of rank 0, every stage's parameters merged)."""
    params = {}
    for _, _, p in results:
        params.update(p)
    losses, norms, _ = results[0]
    return losses, norms, params


# the defaults are fp32 rounding of another summation order per step (losses and parameters 1e-5; norms 1e-6, accumulated in fp64); noise_only entries: the docstring
def compare(result, reference, loss_rtol=1e-5, param_atol=1e-5, norm_rtol=1e-6, noise_only=(), noise_atol=0.0):
    """Per-step losses, grad norms and the final parameters of `result` against `reference`. `noise_only`:
    name suffixes of parameters whose gradient is zero in exact arithmetic (the attention's key bias: the
    softmax of each query's scores ignores the constant q·b_k), so that the optimizer moves them only by
    rounding noise, which Adam normalises into steps of up to its learning rate: they are held to
    `noise_atol` instead of `param_atol`. Returns the largest difference of the other parameters."""
    losses, norms, params = result
    ref_losses, ref_norms, ref_params = reference
    for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) <= loss_rtol * abs(b), f"step {i}: loss {a} vs {b}"
    for i, (a, b) in enumerate(zip(norms, ref_norms, strict=True)):
        if a is not None and b is not None:
            assert abs(a - b) <= norm_rtol * abs(b), f"step {i}: grad norm {a} vs {b}"
    assert set(params) == set(ref_params), set(params) ^ set(ref_params)
    noise = {k for k in params if k.endswith(tuple(noise_only))}
    for k in noise:
        assert (params[k] - ref_params[k]).abs().max().item() <= noise_atol, k
    worst = max((params[k] - ref_params[k]).abs().max().item() for k in params if k not in noise)
    assert worst <= param_atol, f"largest parameter difference {worst}"
    return worst
