"""Whole-model helpers over the parameter metadata of `megazero.tensor_parallel.init`.

* `gather_full_params` / `gather_full_grads`: {logical_name: full tensor} (all-gather over the TP
  group of every split parameter; padding stripped). Used by parity tests and checkpoint export.
* `load_full_params`: the inverse; every rank copies its shard out of full tensors.
* `sync_sequence_parallel_grads`: under sequence parallelism, the gradients of parameters used on
  sequence shards (norms, row-parallel biases, position embeddings) are partial per TP rank; this
  all-reduces them over the TP group. Call it once per step after the last backward and before
  data-parallel reduction and clipping (as Megatron does), not per micro-batch.
* `counts_once_in_norm`: whether this rank counts a parameter in a global norm, so TP-replicated
  parameters are counted once per TP group.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from megazero.runtime import comm
from megazero.runtime.comm import GroupHandle


def unique_params(model_or_layers) -> list[nn.Parameter]:
    """Parameters of a module or an iterable of modules, each once (tied parameters shared by
    object appear once), in definition order. Every one must carry ``logical_name``."""
    mods = [model_or_layers] if isinstance(model_or_layers, nn.Module) else list(model_or_layers)
    seen, out = set(), []
    for mod in mods:
        for name, p in mod.named_parameters():
            if id(p) in seen:
                continue
            if getattr(p, "logical_name", None) is None:  # a user's parameter, not made by make_param
                raise ValueError(f"parameter {name!r} of {type(mod).__name__} has no logical_name; "
                                 f"create it with megazero.tensor_parallel.init.make_param")
            seen.add(id(p))
            out.append(p)
    return out


def _gather_tensor(t: torch.Tensor, p: nn.Parameter, tp_group: GroupHandle) -> torch.Tensor:
    """All-gather shard `t` of parameter `p` along its tp_dim over `tp_group`; strip padding."""
    if p.tp_dim is None:
        return t.detach().clone()
    if p.tp_size != tp_group.size:
        raise ValueError(f"{p.logical_name} is split {p.tp_size} ways but the TP group has {tp_group.size} ranks")
    n = tp_group.size
    local = t.detach().contiguous()
    buf = torch.empty((n * local.shape[0],) + tuple(local.shape[1:]), dtype=local.dtype,
                      device=local.device)  # (n*d0, ...): the shards stacked along dim 0
    comm.all_gather(buf, local, tp_group)
    full = buf if p.tp_dim == 0 else torch.cat(buf.chunk(n, dim=0), dim=p.tp_dim)
    return full.narrow(p.tp_dim, 0, p.full_shape[p.tp_dim]).clone()


def gather_full_params(model_or_layers, tp_group: GroupHandle) -> dict[str, torch.Tensor]:
    """{logical_name: full parameter}; all-gathers every TP-split parameter over `tp_group`
    (every TP rank must call it). A tied parameter present twice keeps the first copy."""
    out = {}
    for p in unique_params(model_or_layers):
        full = _gather_tensor(p, p, tp_group)
        out.setdefault(p.logical_name, full)
    return out


def gather_full_grads(model_or_layers, tp_group: GroupHandle) -> dict[str, torch.Tensor]:
    """{logical_name: full gradient} like `gather_full_params` (a missing grad gathers as zeros).
    Two copies of a tied parameter contribute the sum of their gradients."""
    out: dict[str, torch.Tensor] = {}
    for p in unique_params(model_or_layers):
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        full = _gather_tensor(grad, p, tp_group)
        out[p.logical_name] = out[p.logical_name] + full if p.logical_name in out else full
    return out


def gather_full_tensors(tensors: dict[nn.Parameter, torch.Tensor], tp_group: GroupHandle) -> dict[str, torch.Tensor]:
    """{logical_name: full tensor} of per-parameter shards (e.g. `ZeroOptimizer.reduced_gradients()`):
    all-gathers each TP-split one over `tp_group` (every TP rank must call, with the same parameters
    in the same order). A logical name present twice keeps the first."""
    out: dict[str, torch.Tensor] = {}
    for p, t in tensors.items():
        out.setdefault(p.logical_name, _gather_tensor(t, p, tp_group))
    return out


@torch.no_grad()
def load_full_params(model_or_layers, full: dict[str, torch.Tensor], strict: bool = True) -> list[str]:
    """Copy each parameter's shard out of `full[logical_name]` (padding rows become zeros).

    No communication: every rank needs the full tensors of its own parameters. Returns the names in
    `full` that matched no parameter; with `strict`, a missing or mis-shaped tensor is an error.
    """
    used = set()
    for p in unique_params(model_or_layers):
        src = full.get(p.logical_name)
        if src is None:
            if strict:
                raise KeyError(f"no tensor for parameter {p.logical_name!r}")
            continue
        if tuple(src.shape) != tuple(p.full_shape):
            raise ValueError(f"{p.logical_name}: got shape {tuple(src.shape)}, expected {tuple(p.full_shape)}")
        used.add(p.logical_name)
        if p.tp_dim is None:
            p.copy_(src)
            continue
        n_local = p.shape[p.tp_dim]
        start = p.tp_rank * n_local
        stop = min(start + n_local, p.full_shape[p.tp_dim])
        p.zero_()
        if stop > start:
            p.narrow(p.tp_dim, 0, stop - start).copy_(src.narrow(p.tp_dim, start, stop - start))
    return sorted(set(full) - used)


def sync_sequence_parallel_grads(model_or_layers, tp_group: GroupHandle) -> int:
    """All-reduce (sum) over `tp_group`, in one flat buffer, the gradients of parameters marked
    ``sequence_parallel``. Returns the number of elements reduced (0 when none or tp=1)."""
    grads = [p.grad for p in unique_params(model_or_layers)
             if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads or tp_group.size == 1:
        return 0
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    comm.all_reduce(flat, tp_group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    return flat.numel()


def counts_once_in_norm(p: nn.Parameter, tp_rank: int) -> bool:
    """True when this TP rank should count `p` in a global gradient norm: split parameters on every
    rank (each holds a distinct shard), TP-replicated ones only on TP rank 0."""
    return p.tp_dim is not None or tp_rank == 0


def num_logical_params(params: Iterable[nn.Parameter]) -> int:
    """Elements of the full logical parameters (unpadded), each logical name counted once."""
    seen = {}
    for p in params:
        n = 1
        for d in p.full_shape:
            n *= d
        seen[p.logical_name] = n
    return sum(seen.values())
