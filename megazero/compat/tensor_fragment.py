"""DeepSpeed's per-parameter views of the ZeRO optimizer's state (`deepspeed.utils.safe_get_*` /
`safe_set_*`): a parameter's fp32 master value, its reduced gradient and its optimizer states, whole
(`full`) or this rank's owned piece (`local`), read and written by parameter.

The parameter leads to its optimizer (`p.zero_optimizer`, set by the ZeroOptimizer) and to its place
in a flat group (bucket, range). Full reads all-gather the parameter's bucket over the group's dp
group (every dp rank must call, as in DeepSpeed; stage 0 holds it whole and communicates nothing);
full writes change only the owned slice on each rank (every rank passes the same full value).
Local reads and writes touch this rank's slice only (flattened, 1-D; empty where it owns none).
Writing an fp32 master (full or local) refreshes the working parameters: at stages 1-2 that
all-gathers the group's buckets over dp, so every dp rank must make the call.
Gradients: the reduced fp32 gradient (averaged over dp, loss scale removed, before clipping), valid
after the last backward of a step and before `step()`; writing one changes what the step applies.
Optimizer-state keys: "exp_avg", "exp_avg_sq" (Adam's, as DeepSpeed names them).
"""
from __future__ import annotations

import torch

from megazero.runtime import comm

STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _where(param):
    """(optimizer, flat group, index) of `param`; None when no ZeRO optimizer holds it."""
    ref = getattr(param, "zero_optimizer", None)
    opt = ref() if ref is not None else None
    if opt is None:
        return None
    group, i = opt._where[id(param)]
    return opt, group, i


def _kind(opt, group, what: str) -> list[torch.Tensor]:
    """The per-bucket owned slices of `what` ("fp32", "grad", or an optimizer-state key)."""
    if what == "fp32":
        return group.master
    if what == "grad":
        opt.reduce_grads()
        return group.grad_owned
    if what not in STATE_KEYS:
        raise ValueError(f"optimizer state {what!r}: megazero's Adam keeps {', '.join(STATE_KEYS)}")
    return getattr(group, what)


def _span(group, i):
    """(bucket index, the parameter's [s, e) in the flat buffer, the bucket's owned [lo, hi))."""
    b = group.layout.bucket_of(i)
    s, e = group.layout.param_range(i)
    return b, s, e, group.owned[b]


def _full(param, what: str):
    found = _where(param)
    if found is None:
        return None
    opt, group, i = found
    slices = _kind(opt, group, what)
    b, s, e, (lo, hi) = _span(group, i)
    bk = group.layout.buckets[b]
    if group.stage == 0:  # every rank holds the whole bucket
        whole, base = slices[b], bk.start
    else:
        whole = torch.empty(bk.numel, dtype=torch.float32, device=opt.device)
        comm.all_gather(whole, slices[b].to(opt.device), group.dp)
        base = bk.start
    value = whole[s - base:e - base].clone().view(group.shapes[i])
    return value / opt.scaler.scale if what == "grad" else value


def _set_full(param, value: torch.Tensor, what: str) -> None:
    found = _where(param)
    if found is None:
        raise ValueError("safe_set_full_*: the parameter is not trained by a megazero engine's ZeRO optimizer")
    opt, group, i = found
    slices = _kind(opt, group, what)
    b, s, e, (lo, hi) = _span(group, i)
    if tuple(value.shape) != tuple(group.shapes[i]):
        raise ValueError(f"safe_set_full_*: value of shape {tuple(value.shape)}, the parameter's is "
                         f"{tuple(group.shapes[i])}")
    flat = value.detach().reshape(-1).to(torch.float32)
    if what == "grad":
        flat = flat * opt.scaler.scale
    a, z = max(s, lo), min(e, hi)
    if a < z:
        slices[b][a - lo:z - lo].copy_(flat[a - s:z - s])
    if what == "fp32":
        group.publish_master(1)  # the working parameters follow (stages 1-2: all-gathered over dp)


def _local(param, what: str):
    found = _where(param)
    if found is None:
        return None
    opt, group, i = found
    slices = _kind(opt, group, what)
    b, s, e, (lo, hi) = _span(group, i)
    a, z = max(s, lo), min(e, hi)
    value = slices[b][a - lo:z - lo].clone() if a < z else slices[b].new_empty(0)
    return value / opt.scaler.scale if what == "grad" else value


def _set_local(param, value: torch.Tensor, what: str) -> None:
    found = _where(param)
    if found is None:
        raise ValueError("safe_set_local_*: the parameter is not trained by a megazero engine's ZeRO optimizer")
    opt, group, i = found
    slices = _kind(opt, group, what)
    b, s, e, (lo, hi) = _span(group, i)
    a, z = max(s, lo), min(e, hi)
    if value.numel() != max(0, z - a):
        raise ValueError(f"safe_set_local_*: {value.numel()} elements, this rank owns {max(0, z - a)} of the parameter")
    if a < z:
        flat = value.detach().reshape(-1).to(torch.float32)
        slices[b][a - lo:z - lo].copy_(flat * opt.scaler.scale if what == "grad" else flat)
    if what == "fp32":
        group.publish_master(1)  # the working parameters follow (stages 1-2: all-gathered over dp)


def safe_get_full_fp32_param(param):
    """The parameter's whole fp32 master value (None if no megazero optimizer holds it). Collective over
    its dp group at stages 1-3."""
    return _full(param, "fp32")


def safe_get_full_grad(param):
    """The parameter's whole reduced fp32 gradient (None outside a megazero optimizer). Collective over its
    dp group at stages 1-3 (and, the first time in a step at stages 0-1, the step's reduction)."""
    return _full(param, "grad")


def safe_get_full_optimizer_state(param, optim_state_key: str):
    return _full(param, optim_state_key)


def safe_set_full_fp32_param(param, value) -> None:
    _set_full(param, value, "fp32")


def safe_set_full_grad(param, value) -> None:
    _set_full(param, value, "grad")


def safe_set_full_optimizer_state(param, value, optim_state_key: str) -> None:
    _set_full(param, value, optim_state_key)


def safe_get_local_fp32_param(param):
    return _local(param, "fp32")


def safe_get_local_grad(param):
    return _local(param, "grad")


def safe_get_local_optimizer_state(param, optim_state_key: str):
    return _local(param, optim_state_key)


def safe_set_local_fp32_param(param, value) -> None:
    _set_local(param, value, "fp32")


def safe_set_local_grad(param, value) -> None:
    _set_local(param, value, "grad")


def safe_set_local_optimizer_state(param, value, optim_state_key: str) -> None:
    _set_local(param, value, optim_state_key)
