"""DeepSpeed's MoE helpers (`deepspeed.moe.utils`): which parameters are expert parameters, and the
optimizer parameter groups DeepSpeed's ZeRO wants for them ("moe" groups). Same signatures, same
results; pure bookkeeping, nothing here communicates.

An expert parameter is one `megazero.moe.user_layer.Experts` marked (``allreduce = False``, with its
``group_name``, "ep_size_<P>"), as DeepSpeed's `Experts` marks them. megazero's ZeRO optimizer does not
need the "moe" groups: it reduces every expert parameter (``expert = True``) over the
expert-data-parallel group whatever group it is in (`megazero.zero.grouping.make_groups`); it
accepts them, so that scripts written for DeepSpeed (``--moe-param-group``) run unchanged, and each
group keeps its own hyper-parameters (lr, weight decay, ...) as in torch.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from megazero.moe.user_layer import MoE
from megazero.zero.partitioned_init import full_shape

DEFAULT_MAX_GROUP_SIZE = 178956971
"""DeepSpeed's default `max_group_size`: elements per "moe" group before it is split in several."""


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """(whether `m` holds a `MoE` layer, the first one's num_experts; 0 without one), as DeepSpeed's."""
    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether `param` is an expert parameter (DeepSpeed's mark: an ``allreduce`` attribute that is False)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(params) -> tuple[list, list]:
    """(non-expert parameters, expert parameters) of `params`, in their order."""
    shared, expert = [], []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(group) -> tuple[list, list]:
    """(gradients of the non-expert parameters, of the expert ones) of `group`, skipping parameters
    without a gradient, each in its parameter's dtype."""
    shared, expert = [], []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=DEFAULT_MAX_GROUP_SIZE) -> list:
    """DeepSpeed's split of optimizer parameter groups: `param_groups` (a dict, or a list or tuple of
    dicts, each with "params" and a "name") loses its expert parameters; for each group and each
    expert group name (``group_name``, "ep_size_<P>") a copy of the group's settings with
    ``name = <group_name>``, ``moe = True`` and those experts is appended, cut into groups of at most
    `max_group_size` elements (None: one group each). Returns the list (the given list itself, its
    dicts' "params" replaced, as DeepSpeed's)."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"split_params_into_different_moe_groups_for_optimizer(param_groups=...): a dict or a list "
                         f"or tuple of dicts, got {type(param_groups).__name__}")
    for i, group in enumerate(param_groups):
        if "name" not in group:
            raise KeyError(f"param_groups[{i}] has no 'name' (keys: {sorted(group)}): DeepSpeed's split names each "
                           f"expert group after the group it came from; add e.g. 'name': 'parameters'")
    names = sorted({p.group_name for g in param_groups for p in g["params"] if is_moe_param(p)})
    moe_groups: dict[str, dict[str, dict]] = defaultdict(dict)  # origin group's name -> expert group name -> group
    for group in param_groups:
        for name in names:
            moe_groups[group["name"]][name] = {**group, "name": name, "moe": True, "params": []}
    for group in param_groups:
        kept = []
        for p in group["params"]:
            if is_moe_param(p):
                moe_groups[group["name"]][p.group_name]["params"].append(p)
            else:
                kept.append(p)
        group["params"] = kept
    for by_name in moe_groups.values():
        for group in by_name.values():
            if max_group_size is None:
                param_groups.append(group)
                continue
            for chunk in _chunks(group["params"], max_group_size):
                param_groups.append({**group, "params": chunk})
    return param_groups


def _chunks(params: list, max_size) -> list[list]:
    """`params` cut, in order, into runs of at most `max_size` elements (a parameter larger than that
    alone), as DeepSpeed cuts them: a first parameter larger than `max_size` is preceded by an empty run
    (an empty group, which torch accepts); no run when `params` is empty."""
    runs, current, size = [], [], 0
    for p in params:
        n = p.ds_numel if hasattr(p, "ds_numel") else full_shape(p).numel()
        if size + n > max_size:
            runs.append(current)
            current, size = [], 0
        current.append(p)
        size += n
    if current:
        runs.append(current)
    return runs


def is_moe_param_group(param_group: dict) -> bool:
    """Whether `param_group` is a "moe" group (DeepSpeed's ``moe`` key)."""
    return param_group.get("moe", False)


def configure_moe_param_groups(model_parameters: list) -> list:
    """DeepSpeed's: a list of parameters becomes [{"name": "dense-params", ...}] split into "moe" groups;
    a list of groups is split unless one of them already has a "moe" key."""
    if not isinstance(model_parameters, list):
        raise TypeError(f"configure_moe_param_groups(model_parameters=...): a list, got "
                        f"{type(model_parameters).__name__}")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError("param argument that would be given to the optimizer should be an iterable of Tensors "
                            f"or dicts, but got {type(p)}")
    first = model_parameters[0]
    if isinstance(first, nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters, "name": "dense-params"})
    if isinstance(first, dict) and not any("moe" in g for g in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return model_parameters


__all__ = ["configure_moe_param_groups", "has_moe_layers", "is_moe_param", "is_moe_param_group",
           "split_params_grads_into_shared_and_expert_params", "split_params_into_different_moe_groups_for_optimizer",
           "split_params_into_shared_and_expert_params"]
