"""Which flat group each parameter of a `ZeroOptimizer` goes in, and over which group it is reduced."""
from __future__ import annotations

from megazero.zero.flat_group import FlatGroup
from megazero.zero.partitioned_init import full_shape
from megazero.zero.zeropp import ZeroPlusPlus


def make_groups(params, pctx, stage: int, units, bucket: int, offload_opt: bool, offload_param: bool, persist: int,
                on_reduced, zeropp: ZeroPlusPlus | None = None, *, pin_opt: bool, pin_param: bool) -> list[FlatGroup]:
    """The flat groups a `ZeroOptimizer` of `stage` lays `params` out in, each with the group its gradients
    are reduced over: routed MoE experts (the expert-data-parallel group, averaged over all of dp; at
    stage 3 sharded and gathered per unit), the rest ("main"; at stage 3 "sharded" per unit and small
    "persistent" ones), and weights tied across pipeline stages ("tied"). `units`: the modules stage 3
    gathers one at a time; `on_reduced(group, b)`: a bucket's reduction landed; `zeropp`: the ZeRO++
    options of the stage-3 groups over dp ("sharded", "tied"; not the experts'). `pin_opt`, `pin_param`:
    zero.offload_optimizer.pin_memory and zero.offload_param.pin_memory; each host buffer follows the flag
    of the offload that put it on the host (a stage-3 parameter shard: offload_param's, or the optimizer's
    when only that is offloaded; the master, moments and gradient staging: offload_optimizer's, or
    offload_param's when only that is offloaded). Local: builds the groups, no communication."""
    tied_across_stages = pctx.pp_size > 1
    experts = [p for p in params if getattr(p, "expert", False)]  # MoE routed experts: split over ep
    params = [p for p in params if not getattr(p, "expert", False)]
    is_tied = [tied_across_stages and getattr(p, "tied_name", None) is not None for p in params]
    tied = [p for p, t in zip(params, is_tied) if t]
    rest = [p for p, t in zip(params, is_tied) if not t]
    pins = dict(pin_params=pin_param if offload_param else pin_opt,
                pin_optimizer=pin_opt if offload_opt else pin_param)
    dp = pctx.dp_cp_group  # every replica of a parameter: dp x cp ranks (the dp group itself without cp)
    groups = []
    unit_of = {}
    for u, mod in enumerate(units or []):
        for p in mod.parameters():
            unit_of.setdefault(id(p), u)
    if experts:  # reduced over the expert-data-parallel group, averaged over all of dp (see FlatGroup)
        edp = getattr(pctx, "edp_cp_group", dp)  # the ranks holding these experts: (dp / ep) x cp
        if stage == 3 and all(id(p) in unit_of for p in experts):  # sharded and gathered per unit too
            experts, cuts = _by_unit(experts, unit_of)
            groups.append(FlatGroup("experts", experts, edp, 3, bucket, cuts, True, offload_param or offload_opt,
                                    on_reduced, grad_divisor=dp.size, **pins))
        else:
            groups.append(FlatGroup("experts", _backward_order(experts, units), edp, min(stage, 2), bucket, (), False,
                                    offload_opt, on_reduced, grad_divisor=dp.size, **pins))
    if stage == 3:
        big = {id(p) for p in rest if id(p) in unit_of and full_shape(p).numel() >= persist}
        sharded = [p for p in rest if id(p) in big]
        persistent = [p for p in rest if id(p) not in big]
        sharded, cuts = _by_unit(sharded, unit_of)
        if sharded:
            groups.append(FlatGroup("sharded", sharded, dp, 3, bucket, cuts, True, offload_param or offload_opt, on_reduced,
                                    zeropp=zeropp, **pins))
        if persistent:
            groups.append(FlatGroup("persistent", _backward_order(persistent, units), dp, 2, bucket, (), False,
                                    offload_opt, on_reduced, **pins))
    elif rest:
        groups.append(FlatGroup("main", _backward_order(rest, units), dp, stage, bucket, (), False, offload_opt,
                                on_reduced, **pins))
    if tied:
        tied.sort(key=lambda p: p.tied_name)  # the same layout on first and last stage
        shard = stage == 3
        groups.append(FlatGroup("tied", tied, dp, stage, bucket, (), shard,
                                offload_opt or (shard and offload_param), on_reduced, zeropp=zeropp if shard else None,
                                **pins))
    return groups


def _backward_order(params, units) -> list:
    """`params` in the order backward completes their gradients, as far as `units` (modules in forward
    order) tell: the last unit first, inside a unit its parameters in reverse registration order; those
    of no unit after them, in reverse given order. Buckets are reduced in index order, so a bucket
    holding a parameter whose gradient comes last (a norm weight of the first layer placed with the last
    layer's) would hold back every reduction after it: no overlap, and every bucket alive at once."""
    if not units:
        return params[::-1]
    where = {}
    for u, mod in enumerate(units):
        for j, p in enumerate(mod.parameters()):
            where.setdefault(id(p), (u, j))
    inside = sorted((p for p in params if id(p) in where), key=lambda p: (-where[id(p)][0], -where[id(p)][1]))
    return inside + [p for p in params if id(p) not in where][::-1]


def _by_unit(params, unit_of: dict) -> tuple[list, list[int]]:
    """`params` in reverse unit order (the order backward fills them) and the indices where a unit
    starts (bucket boundaries, so that stage 3 gathers and releases whole units)."""
    ordered = sorted(params, key=lambda p: -unit_of[id(p)])
    cuts = [i for i in range(1, len(ordered)) if unit_of[id(ordered[i])] != unit_of[id(ordered[i - 1])]]
    return ordered, cuts


__all__ = ["make_groups"]
