"""Deferred weight gradients for zero-bubble pipeline schedules (Qi et al., ICLR 2024), and the
sequence-parallel re-gather of column-parallel inputs (Korthikanti et al. 2022).

A linear layer's backward has two GEMMs: the input gradient (gx = gy·W, on the critical path:
the previous stage waits for it) and the weight gradient (gW = gyᵀ·x, needed only by the
optimizer). Zero-bubble schedules run the first in B and the second later in W, filling the
pipeline's cool-down bubble. While a `WeightGradStore` is `deferring`, every linear layer that
holds it computes only gx (and its bias gradient) and leaves (weight, x, gy) in the store; W runs
`compute(entry)` for each. No communication.

The store is an object created per stage when the schedule splits backward
(`megazero.engine.factories.build_model`, or the pipeline engine for a user's PipelineModule) and
handed to the stage's linear layers in their constructors (``wgrad_store=``, through
`layer_builders`); never a global. A user's PipelineModule has no store: the pipeline engine makes
one and `defer_linears` routes the module's plain ``nn.Linear`` layers through `linear(..., store)`,
so they split B and W too (a torch-function mode would do it for any ``F.linear``, but it taxes every
op of the forward: +15% here on small blocks).

Under sequence parallelism the input of a column-parallel region is all-gathered along the
sequence. Saving the gathered (s, b, h) tensor for the weight gradients costs t times the shard;
with a `Regather` handle the linear layers save only this rank's shard (s/t, b, h) and all-gather
it again over the TP group in backward, once per region (shared by q, k and v, or gate and up):
the memory of Korthikanti et al.'s TP+SP row at the cost of one more all-gather per region.
"""
from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F


class WeightGradStore:
    """The deferred (weight, x, gy) triples of one stage, between a B and its W."""

    def __init__(self):
        self.deferring = False
        self._pending: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] = []

    @contextlib.contextmanager
    def defer(self):
        """Within the block, linear layers holding this store defer their weight-gradient GEMMs."""
        self.deferring = True
        try:
            yield self
        finally:
            self.deferring = False

    def push(self, weight, x, grad_out) -> None:
        self._pending.append((weight, x, grad_out))

    def take(self) -> list:
        """The deferred (weight, input, output-grad) triples since the last take."""
        out, self._pending = self._pending, []
        return out

    @staticmethod
    @torch.no_grad()
    def compute(entry) -> tuple[torch.nn.Parameter, torch.Tensor]:
        """(weight, its gradient) of one deferred GEMM: gW = gyᵀ·x over all leading dims. A plain
        tensor: the saved x may still carry autograd history, W's GEMM is never differentiated."""
        weight, x, gy = entry
        return weight, gy.reshape(-1, gy.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))  # (out, in)

    @staticmethod
    @torch.no_grad()
    def add_into(entry, out: torch.Tensor) -> None:
        """out (out, in) += gW of one deferred GEMM, in one addmm (the same product as `compute`,
        accumulated in place); inputs of another dtype than `out` (bf16/fp16 activations into fp32
        gradients) go through a product in their dtype, then an add."""
        _, x, gy = entry
        gy2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])  # (rows, out), (rows, in)
        if gy2.dtype == out.dtype and x2.dtype == out.dtype:
            out.addmm_(gy2.t(), x2)
        else:
            out.add_(gy2.t().mm(x2))


class Regather:
    """One column-parallel region's input under sequence parallelism: the shard (s/t, b, h) and the
    gather back to (s, b, h) over `group` in backward, done once and shared by the region's `uses`
    linear layers (communicates: one all-gather along dim 0 over the TP group)."""

    def __init__(self, shard: torch.Tensor, group, uses: int, gather_fn):
        self.shard, self.group, self.left, self.gather_fn = shard, group, uses, gather_fn
        self._full = None

    def full(self, shard: torch.Tensor) -> torch.Tensor:
        if self._full is None:
            self._full = self.gather_fn(shard, self.group)  # (s, b, h)
        out = self._full
        self.left -= 1
        if self.left <= 0:
            self._full = None
        return out


class _Linear(torch.autograd.Function):
    """y = x·Wᵀ (+ b). Backward defers gW to `store` while it is deferring; with `regather`, x is
    not saved: the region's shard is, and x is gathered again for gW. Under autocast backward's
    GEMMs run under forward's autocast (as F.linear's would)."""

    @staticmethod
    def forward(ctx, x, weight, bias, store, regather):
        # the weight is kept as the Parameter itself (not a saved tensor): saved-tensor hooks
        # (checkpointing, the memory meter) would hand back a plain tensor, and W must name the
        # parameter it accumulates into
        ctx.save_for_backward(regather.shard if regather is not None else x)
        ctx.weight, ctx.has_bias, ctx.store, ctx.regather = weight, bias is not None, store, regather
        ctx.autocast = autocast_dtype(x)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        (saved,), weight = ctx.saved_tensors, ctx.weight
        needs_x, needs_w, needs_b = ctx.needs_input_grad[:3]  # a frozen weight gets no GEMM and no entry
        x = ctx.regather.full(saved) if ctx.regather is not None else saved  # (..., in)
        with autocast_like(saved, ctx.autocast):
            gx = gy.matmul(weight) if needs_x else None  # (..., in)
            gb = gy.reshape(-1, gy.shape[-1]).sum(0) if ctx.has_bias and needs_b else None
            gw = None
            if needs_w and ctx.store is not None and ctx.store.deferring:
                ctx.store.push(weight, x, gy)
            elif needs_w:
                gw = gy.reshape(-1, gy.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
        return gx, gw, gb, None, None  # autograd casts each gradient to its input's dtype


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast casts GEMMs to on `x`'s device type, or None when autocast is off there."""
    device = x.device.type
    if device == "meta":  # the dry run: no autocast on meta
        return None
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def autocast_like(x: torch.Tensor, dtype: torch.dtype | None):
    """Autocast to `dtype` on `x`'s device type (a backward redoing forward's autocast), or nothing."""
    return torch.autocast(x.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def linear(x, weight, bias=None, store: WeightGradStore | None = None, regather: Regather | None = None):
    """F.linear, or its twin when a store is attached (zero bubble) or the input is re-gathered in
    backward (sequence parallelism). Under autocast a store is ignored (autocast casts inside the GEMM,
    so W's entries would mix dtypes): the weight GEMM runs in B."""
    if autocast_dtype(x) is not None:
        store = None
    if store is None and regather is None:
        return F.linear(x, weight, bias)
    return _Linear.apply(x, weight, bias, store, regather)


def defer_linears(module: torch.nn.Module, store: WeightGradStore) -> int:
    """Route every plain ``nn.Linear`` inside `module` (exactly that class: a subclass may compute
    otherwise) through `linear(x, weight, bias, store)`, so that zero-bubble schedules defer its weight
    GEMM to W; outside a B it computes the weight gradient at once, as before. Returns how many."""
    count = 0
    for mod in module.modules():
        if type(mod) is torch.nn.Linear:
            mod.forward = types.MethodType(_store_linear_forward(store), mod)
            count += 1
    return count


def _store_linear_forward(store: WeightGradStore):
    def forward(self, x):
        return linear(x, self.weight, self.bias, store)  # under autocast torch's own F.linear: not deferred
    return forward
