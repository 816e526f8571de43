"""Whole-model views of a `ZeroOptimizer`'s flat, sharded state, for code outside the training
step: the full parameters inside a block (`megazero.zero.GatheredParameters`, checkpoints, parity
checks), the reduced gradients (inspection and parity), and the first parameter with a non-finite
gradient (the error of ``nonfinite_gradients=error``). The first two all-gather over the
flat groups' dp group (every dp rank must call); the last is local.
"""
from __future__ import annotations

import contextlib

import torch

from megazero.runtime import comm


@contextlib.contextmanager
def full_parameters(opt, writeback: bool = False, params=None, modifier_rank: int | None = None):
    """Within the block every parameter (or those in `params`) holds its full (this rank's TP
    shard) value; at stage 3 this all-gathers the sharded buckets over dp and releases them after.
    With `writeback`, values written into the parameters inside the block are kept (stage 3 copies
    each rank's owned slice back into its shard) and the fp32 master is refreshed from them. With
    `modifier_rank`, that dp rank's values of `params` are broadcast over dp first (what
    `megazero.zero.GatheredParameters(params, modifier_rank)` does), then written back."""
    wanted = None if params is None else {id(p) for p in params}
    held = []
    try:
        for group in opt.groups:
            if group.shard_params:
                for b, bk in enumerate(group.layout.buckets):
                    if wanted is None or any(id(group.params[i]) in wanted for i in bk.params):
                        _, full = group.gather_bucket(b, exact=True)  # never int8 (ZeRO++ qwZ): written back
                        group.attach_bucket(b, full)
                        held.append((group, b, full))
        yield
        if modifier_rank is not None:
            for group in opt.groups:
                # dp rank d is index d // ep of its expert-data-parallel group (MoE experts; ep = 1 otherwise)
                src = modifier_rank // (opt.pctx.dp_cp_group.size // group.dp.size)
                for p in group.params:
                    if wanted is None or id(p) in wanted:
                        comm.broadcast(p.data, src, group.dp)
            writeback = True
        if writeback:
            for group, b, full in held:
                start = group.layout.buckets[b].start
                lo, hi = group.owned[b]
                group.param_owned[b].copy_(full[lo - start:hi - start])
            for group in opt.groups:
                group.forget_secondary()  # ZeRO++ hpZ: the parts kept hold the old values
                if group.separate_master:
                    for m, w in zip(group.master, group.param_owned):
                        m.copy_(w)
    finally:
        for group, b, _ in held:
            group.release_bucket(b)


def reduced_gradients(opt) -> dict:
    """{parameter: its reduced fp32 gradient, loss scale removed, not clipped (this TP shard's
    shape)}, after `reduce_grads` and before `step` (which reduces first if needed). Stage 0 holds
    whole reduced buckets; stages 1-3 hold one owned slice of each, all-gathered here over the dp
    group (every dp rank must call). For inspection and parity checks, not the training path."""
    opt.reduce_grads()
    inv = 1.0 / opt.scaler.scale
    out = {}
    for group in opt.groups:
        layout = group.layout
        full = []  # one reduced bucket per entry, (bucket numel,)
        for b, bk in enumerate(layout.buckets):
            if group.stage == 0:
                full.append(group.grad_flat[bk.start:bk.end])
            else:
                buf = torch.empty(bk.numel, dtype=torch.float32, device=opt.device)
                comm.all_gather(buf, group.grad_owned[b].to(opt.device), group.dp)
                full.append(buf)
        for i, p in enumerate(group.params):
            s, e = layout.param_range(i)
            bk = layout.buckets[layout.bucket_of(i)]
            out[p] = (full[bk.index][s - bk.start:e - bk.start] * inv).view(group.shapes[i])
    return out


def first_nonfinite(opt) -> str | None:
    """The logical name of the first parameter whose owned gradient slice is not finite, here."""
    for group in opt.groups:
        for b, segs in enumerate(group.segments):
            lo = group.owned[b][0]
            for s in segs:
                if not torch.isfinite(group.grad_owned[b][s.buf_start - lo:s.buf_end - lo]).all():
                    param = group.params[s.param]
                    return getattr(param, "logical_name", None) or f"{group.name} group parameter {s.param}"
    return None
