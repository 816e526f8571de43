"""Parameter groups of the ZeRO optimizer: which rules a group obeys, Megatron's decay split, the
hyper-parameters a checkpoint keeps, and where each group's parameters sit in the flat buffers.

A group is torch's: a dict with "params" and any of lr, betas, eps, weight_decay and momentum (the
rest come from the optimizer's defaults). Every step reads each group's values from `param_groups`, so torch's LR schedulers and
client code that edits them drive the update. Pure bookkeeping: nothing here communicates.
"""
from __future__ import annotations

import torch

from megazero.zero.flat_group import FlatGroup
from megazero.zero.partitioned_init import full_shape


def megatron_param_groups(params, weight_decay: float) -> list[dict]:
    """Megatron's split: [{params with decay}, {biases and norm weights (1-D), weight_decay 0}], both
    kept when empty (every pipeline stage has the same two groups). A parameter with a
    `no_weight_decay` attribute says for itself."""
    decay, no_decay = [], []
    for p in params:
        (no_decay if getattr(p, "no_weight_decay", len(full_shape(p)) < 2) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def checked_group(param_group: dict, existing: list[dict], defaults: dict) -> dict:
    """`param_group` made a group next to `existing` ones: torch's rules (an ordered collection of
    leaf tensors, no parameter in two groups) and `defaults` for what it leaves out. Not torch's
    `add_param_group` itself: its dynamo guard imports torch._dynamo, seconds in every process."""
    params = param_group["params"]
    if isinstance(params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, not a set")
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"optimizer can only optimize Tensors, got {type(p).__name__}")
        if not p.is_leaf:
            raise ValueError("can't optimize a non-leaf Tensor")
    seen = {id(q) for group in existing for q in group["params"]}
    if any(id(p) in seen for p in params):
        raise ValueError("some parameters appear in more than one parameter group")
    param_group["params"] = params
    for key, value in defaults.items():
        param_group.setdefault(key, value)
    return param_group


def group_runs(group: FlatGroup, group_index: dict[int, int]) -> list[list[tuple[int, int, int]]]:
    """Per bucket of `group`, the maximal contiguous local ranges (start, end, parameter-group index)
    of this rank's owned slice whose parameters share one parameter group (`group_index`: id of a
    parameter -> its group), so that a step updates each run with one set of hyper-parameters."""
    out = []
    for b, segs in enumerate(group.segments):
        lo, runs = group.owned[b][0], []
        for s in segs:
            g = group_index[id(group.params[s.param])]
            a, e = s.buf_start - lo, s.buf_end - lo
            if runs and runs[-1][2] == g and runs[-1][1] == a:
                runs[-1] = (runs[-1][0], e, g)
            else:
                runs.append((a, e, g))
        out.append(runs)
    return out


def hyperparameters(param_groups: list[dict]) -> list[dict]:
    """Each group's settings without its parameters (lr, betas, …, and whatever an LR scheduler
    added, such as initial_lr), JSON-ready, for checkpoints."""
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in pg.items() if k != "params"}
            for pg in param_groups]


def load_hyperparameters(param_groups: list[dict], saved: list[dict]) -> None:
    """Restore `hyperparameters()` into the same number of groups."""
    if len(saved) != len(param_groups):
        raise ValueError(f"the saved optimizer had {len(saved)} parameter groups, this one has "
                         f"{len(param_groups)}; build the optimizer with the same groups")
    for pg, h in zip(param_groups, saved):
        pg.update({k: (tuple(v) if k == "betas" else v) for k, v in h.items()})
