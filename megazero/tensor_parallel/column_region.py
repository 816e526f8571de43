"""A column-parallel region as ONE autograd Function: the region's entry (f, or the sequence all-gather)
fused with its linear layers, so that backward overlaps the input gradient's reduction over the TP
group with the weight-gradient GEMMs (Megatron-LM's async_tensor_model_parallel_allreduce and its
sequence-parallel reduce-scatter overlap).

The N linears of a region share one input: q, k and v; gate and up; a lone fc1. Forward:

    full = x  (f: identity)   or   full = all-gather of x along dim 0  (sequence parallelism)
    y_i  = full·W_iᵀ + b_i

Backward (`_ColumnRegion.backward`, the one place where communication overlaps computation):

    1. sequence parallelism: launch the all-gather of the saved shard, which only the weight GEMMs read
    2. gx = Σ_i gy_i·W_i: the input gradient, summed over the region's linears
    3. launch the reduction of gx over the TP group: an all-reduce, or a reduce-scatter along dim 0
       under sequence parallelism (async_op=True)
    4. wait for 1; gW_i = gy_iᵀ·full and gb_i while 3 is in flight
    5. wait for 3; return

Separate autograd nodes (f, then one node per linear) cannot do this: autograd runs f's backward, and
so its all-reduce, only after every linear's whole backward, weight GEMMs included.

Communication equals the unfused composition (`mappings.enter_column_region`, then each linear with
the `weight_grad.Regather` handle): the same collectives, elements and bytes in ``group.stats``;
under sequence parallelism only the shard (s/t, b, h) is saved and gathered again in backward, once
per region. Zero bubble: while `store` is deferring, step 4 leaves (W_i, full, gy_i) in the store
instead (no GEMM to overlap; W computes them). A frozen weight gets no GEMM and no store entry (and,
under sequence parallelism, a region of frozen weights no re-gather); an input that needs no gradient
gets no input GEMM and no reduction. Under autocast, backward's GEMMs run under forward's autocast
(as F.linear's would), the reduction in the input's dtype (as f's), and the weight GEMMs are not
deferred (as for the routed ``nn.Linear`` of `weight_grad.defer_linears`). With a TP group of one rank
there is no communication and each linear is `weight_grad.linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megazero.runtime import comm
from megazero.runtime.comm import GroupHandle
from megazero.tensor_parallel.weight_grad import WeightGradStore, autocast_dtype, autocast_like, linear


class _InFlight:
    """A collective launched with ``async_op=True`` over `group` and the tensor it fills; `wait()` returns the
    tensor (noted as received: `comm.note`)."""

    def __init__(self, out: torch.Tensor, work, group: GroupHandle):
        self.out, self.work, self.group = out, work, group

    def wait(self) -> torch.Tensor:
        comm.wait(self.work, self.group, self.out)
        return self.out


def _launch_all_gather(shard: torch.Tensor, group: GroupHandle) -> _InFlight:
    """All-gather `shard` (s/t, b, h) along dim 0 over `group` into (s, b, h), in rank order."""
    shard = shard.contiguous()
    out = shard.new_empty((group.size * shard.shape[0],) + tuple(shard.shape[1:]))  # (s, b, h)
    return _InFlight(out, comm.all_gather(out, shard, group, async_op=True), group)


def _launch_reduce_scatter(full: torch.Tensor, group: GroupHandle) -> _InFlight:
    """Sum `full` (s, b, h) over `group`; this rank keeps its chunk (s/t, b, h) of dim 0."""
    out = full.new_empty((full.shape[0] // group.size,) + tuple(full.shape[1:]))  # (s/t, b, h)
    return _InFlight(out, comm.reduce_scatter(out, full, group, async_op=True), group)


def _launch_all_reduce(x: torch.Tensor, group: GroupHandle) -> _InFlight:
    """Sum `x` over `group`, in place."""
    return _InFlight(x, comm.all_reduce(x, group, async_op=True), group)


def _input_grad(gys, weights) -> torch.Tensor:
    """Σ_i gy_i·W_i, the input gradient of all the region's linears: gy_i (..., out_i) -> (..., in).

    Each product is rounded to the working dtype and the sum taken last to first, as autograd sums the
    unfused linears' input gradients: the region is then bit for bit the unfused composition (a chain
    of addmm accumulating in fp32 would be more precise in bf16, and differ from one process's run)."""
    parts = [gy.reshape(-1, gy.shape[-1]).mm(w) for gy, w in zip(gys, weights)]  # (rows, in) each
    gx = parts[-1]
    for p in reversed(parts[:-1]):
        gx = gx + p
    return gx.view(*gys[0].shape[:-1], gx.shape[-1])


class _ColumnRegion(torch.autograd.Function):
    """Entry of a column-parallel region (f, or the all-gather of the sequence) and its linears, in one
    node; see the module docstring. Communicates over the TP group: forward, the all-gather under
    sequence parallelism; backward, one reduction of the summed input gradient (async, overlapped with
    the weight GEMMs) and, under sequence parallelism, the re-gather of the input shard."""

    @staticmethod
    def forward(ctx, x, group, sequence_parallel, store, *params):
        weights, biases = params[0::2], params[1::2]
        full = _launch_all_gather(x, group).wait() if sequence_parallel else x  # (s, b, h)
        # under sequence parallelism x is the shard (s/t, b, h): gathered again in backward. The weights
        # are kept as the Parameters themselves, as in weight_grad._Linear (W must name them)
        ctx.save_for_backward(x)
        ctx.group, ctx.sequence_parallel, ctx.store = group, sequence_parallel, store
        ctx.weights, ctx.has_bias = weights, [b is not None for b in biases]
        ctx.autocast = autocast_dtype(x)
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *gys):
        (saved,), group, weights = ctx.saved_tensors, ctx.group, ctx.weights
        needs_x, needs_w, needs_b = ctx.needs_input_grad[0], ctx.needs_input_grad[4::2], ctx.needs_input_grad[5::2]
        defer = ctx.store is not None and ctx.store.deferring
        reduce = _launch_reduce_scatter if ctx.sequence_parallel else _launch_all_reduce
        with autocast_like(saved, ctx.autocast):
            gathering = _launch_all_gather(saved, group) if ctx.sequence_parallel and any(needs_w) else None
            reducing = reduce(_input_grad(gys, weights).to(saved.dtype), group) if needs_x else None
            full = gathering.wait() if gathering is not None else saved  # (s, b, h)
            grads = []
            for gy, w, need_w, need_b, has_b in zip(gys, weights, needs_w, needs_b, ctx.has_bias):
                gy2 = gy.reshape(-1, gy.shape[-1])  # (rows, out_i)
                gw = None
                if need_w and defer:
                    ctx.store.push(w, full, gy)
                elif need_w:
                    gw = gy2.t().mm(full.reshape(-1, full.shape[-1]))  # (out_i, in)
                grads += [gw, gy2.sum(0) if has_b and need_b else None]
            gx = reducing.wait() if reducing is not None else None  # (..., in); (s/t, b, in) under SP
        # under autocast, autograd casts each gradient to its input's dtype (as F.linear's casts would)
        return (gx, None, None, None, *grads)


def column_region(x: torch.Tensor, weights, biases, group: GroupHandle, sequence_parallel: bool = False,
                  store: WeightGradStore | None = None) -> tuple[torch.Tensor, ...]:
    """y_i = enter(x)·W_iᵀ + b_i for each (W_i, b_i) of one column-parallel region (a bias may be None),
    where enter is f (identity forward) or, with `sequence_parallel`, the all-gather of dim 0 over
    `group`. Backward reduces the summed input gradient over `group` (all-reduce, or reduce-scatter
    along dim 0) while the weight-gradient GEMMs run (see the module docstring); `store` defers them
    while it is deferring.

    Shapes: x (..., in) [(s/t, b, in) under sequence parallelism]; y_i (..., out_i) [(s, b, out_i)].
    """
    if group.size == 1:
        return tuple(linear(x, w, b, store) for w, b in zip(weights, biases))
    if autocast_dtype(x) is not None:
        store = None  # autocast casts inside the GEMMs: W's entries would mix dtypes, so they run in B
    params = [t for pair in zip(weights, biases) for t in pair]
    return _ColumnRegion.apply(x, group, sequence_parallel, store, *params)
