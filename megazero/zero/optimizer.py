"""ZeRO stages 0-3 on the data-parallel axis, composing with tensor and pipeline parallelism.

`ZeroOptimizer(params, pctx, ...)` flattens the parameters of one model-parallel rank (its pipeline
stage's TP shard) into `FlatGroup`s, accumulates gradients in fp32 through post-accumulate-grad
hooks, reduces them over `pctx.dp_cp_group` (the dp group, and its cp ranks with context parallelism), and updates the fp32 master shard with the fused Adam of
`megazero.runtime.kernels`.

Communication per optimizer step (Ψ = this rank's parameters, ring volumes, see docs/reference.md):
- stage 0: all-reduce of the gradient buckets once per step (2Ψ·(Nd−1)/Nd).
- stage 1: reduce-scatter once per step + all-gather of the updated params (2Ψ·(Nd−1)/Nd).
- stage 2: reduce-scatter after every micro-batch's backward (gradients are never held in full
  across micro-batches) + all-gather after the step: (m+1)Ψ·(Nd−1)/Nd for m micro-batches.
- stage 3: all-gather of each layer before forward and again before backward, reduce-scatter
  after its backward: 3Ψ·(Nd−1)/Nd per micro-batch.
Over other groups: tied embedding/head gradients are summed over `pctx.embedding_group` (their shards
line up: tied parameters live in their own flat group with the same layout on both stages); the
overflow flag (max) and the squared gradient norm (sum) are all-reduced over `pctx.world_group`.

It is a `torch.optim.Optimizer`: `params` are parameters or parameter groups (dicts with
"params" and any of lr, betas, eps, weight_decay, momentum; the rest come from `spec`), and every
step reads each group's hyper-parameters from `param_groups`, so torch's LR schedulers (and any code
that edits `param_groups`) drive the update. Weight decay is exactly what each group says;
`megazero.zero.param_groups.megatron_param_groups` makes Megatron's split (no decay for biases and norm weights), which
megazero applies to the models it builds.

The parameters may be a user's (any nn.Module under ModuleEngine), so the attributes megazero's
layers give theirs at construction are read with defaults (duck typing of user objects): `tp_dim`
(a TP shard; None: replicated, counted once in the norm), `sequence_parallel` (a partial gradient per
TP rank), `tied_name` (summed over the embedding group).
"""
from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass

import torch

from megazero.core.config.schema import NONFINITE_CHOICES
from megazero.runtime import comm, kernels
from megazero.runtime.kernels.reference import sgd_step
from megazero.zero.flat_group import FlatGroup
from megazero.zero.grouping import make_groups
from megazero.zero.loss_scaler import LossScaler
from megazero.zero.offload_overlap import EarlyUpdates
from megazero.zero.onebit import OneBitAdam
from megazero.zero.zeropp import ZeroPlusPlus
from megazero.zero.param_groups import checked_group, group_runs, hyperparameters, load_hyperparameters
from megazero.zero import views
from megazero.zero.stage3 import Stage3Gatherer
from megazero.zero.unit_ends import UnitEnds


NONFINITE = NONFINITE_CHOICES  # one list: the config schema's
"""What a step with inf/NaN gradients does: skip it (and count it), stop every rank with an error, or
ignore (no check: the update uses them, as torch's optimizers and DeepSpeed's bf16 do)."""


class NonFiniteGradients(RuntimeError):
    """A step's reduced gradients hold inf or NaN and ``nonfinite_gradients=error``."""


@dataclass(frozen=True)
class OptimizerSpec:
    """The update rule: type adam|adamw|sgd and its hyper-parameters."""

    type: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    bias_correction: bool = True
    freeze_step: int = 100  # onebit_adam: the Adam steps before the momentum is averaged in 1 bit


class ZeroOptimizer(torch.optim.Optimizer):
    """See the module docstring. Use: `scale_loss(loss).backward()` per micro-batch, then
    `after_backward()` per micro-batch, `step()` once per global batch (it reduces, unscales,
    checks overflow, clips, updates, publishes and zeroes the gradients).

    `units`: the modules in forward order (stage 3 gathers one at a time; every stage lays its buckets out in
    the order backward completes them, `grouping._backward_order`). `data_dependent_graph`: the
    model may leave parameters without a gradient on some ranks only (a user's module under the module
    engine); stages 2-3 then launch their reductions at the end of each unit's backward
    (`megazero.zero.unit_ends.UnitEnds`) instead of when a bucket completes, so every dp rank issues
    them at the same places. `own_backward_only`: gradients enter the flat buffers only inside
    `own_backward()` (the module engine's backward); those autograd computes elsewhere (another engine's
    backward through these parameters, a `loss.backward()` of the user's, a `p.grad` write) stay in
    `p.grad` as PyTorch leaves them, where `module.zero_grad()` clears them (see `own_backward` for when the
    rest join the step's gradient). Off: every gradient autograd accumulates is taken (megazero's
    pipelines, whose executor runs the backward). `offload_optimizer_pin_memory`,
    `offload_param_pin_memory` (zero.offload_*.pin_memory, true as in DeepSpeed): the offloaded host
    buffers are page-locked, where CUDA exists (`flat_group.host_pinned`; `grouping.make_groups` says
    which buffer follows which flag)."""

    def __init__(self, params, pctx, stage: int = 0, spec: OptimizerSpec = OptimizerSpec(),
                 reduce_bucket_size: int = 500_000_000, allgather_bucket_size: int = 500_000_000,
                 overlap_comm: bool = False, offload_optimizer: bool = False, offload_param: bool = False,
                 gradient_clipping: float = 0.0, loss_scaler: LossScaler | None = None,
                 units=None, prefetch_bucket_size: int = 50_000_000, param_persistence_threshold: int = 0,
                 nonfinite: str = "skip", zeropp: ZeroPlusPlus | None = None, data_dependent_graph: bool = False,
                 own_backward_only: bool = False, offload_optimizer_pin_memory: bool = True,
                 offload_param_pin_memory: bool = True):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"zero.stage must be 0, 1, 2 or 3, got {stage}")
        if spec.type not in ("adam", "adamw", "sgd", "onebit_adam"):
            raise ValueError(f"optimizer.type {spec.type!r} is not one of adam, adamw, sgd, onebit_adam")
        if offload_param and stage != 3:
            raise ValueError("zero.offload_param needs zero.stage 3")
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite_gradients={nonfinite!r} is not one of {', '.join(NONFINITE)}")
        self.nonfinite, self.skipped_steps = nonfinite, 0
        self.updating = False  # inside an update: the state is neither the last step's nor the next's
        if zeropp is not None and zeropp != ZeroPlusPlus() and stage != 3:
            raise ValueError(f"zero.quantized_weights / quantized_gradients / hpz_partition_size (ZeRO++) need "
                             f"zero.stage 3, got {stage}")
        if offload_optimizer and stage == 0:
            raise ValueError("zero.offload_optimizer needs zero.stage 1, 2 or 3")
        self.pctx, self.stage, self.spec = pctx, stage, spec
        self.overlap = overlap_comm
        if allgather_bucket_size < 1 or reduce_bucket_size < 1:
            raise ValueError("zero.reduce_bucket_size and zero.allgather_bucket_size must be >= 1 element")
        self.allgather_bucket_size = allgather_bucket_size
        self.clip = gradient_clipping
        self.scaler = loss_scaler or LossScaler.static(1.0)
        self.step_count = 0
        self.last_microbatch = True
        self._reduced = False
        self._early = None  # EarlyUpdates, set below when the step allows them
        self.own_backward_only = own_backward_only
        self._in_own_backward = False  # inside `own_backward()`
        self._boundary_backward = False  # stages 0-1 with overlap_comm: a backward at the boundary ran this step
        defaults = {"lr": spec.lr, "betas": tuple(spec.betas), "eps": spec.eps, "weight_decay": spec.weight_decay,
                    "momentum": spec.momentum}
        given = list(params)
        super().__init__(given or [{"params": []}], defaults)  # checks: leaf tensors, no parameter in two groups
        self._group_index = {id(p): g for g, pg in enumerate(self.param_groups) for p in pg["params"]}
        seen, unique = set(), []
        for pg in self.param_groups:
            for p in pg["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    unique.append(p)
        self.groups = make_groups(unique, pctx, stage, units, reduce_bucket_size, offload_optimizer, offload_param,
                                  param_persistence_threshold, self._bucket_reduced, zeropp,
                                  pin_opt=offload_optimizer_pin_memory, pin_param=offload_param_pin_memory)
        self._where = {id(p): (group, i) for group in self.groups for i, p in enumerate(group.params)}
        for group in self.groups:  # megazero.zero.GatheredParameters finds the optimizer of a parameter
            for p in group.params:
                p.zero_optimizer = weakref.ref(self)
        self.device = unique[0].device if unique else torch.device("cpu")
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for group in self.groups for p in group.params]
        self._counted = [self._counted_ranges(group) for group in self.groups]
        self._counted_own = [self._counted_ranges(group, every_dp_rank=True) for group in self.groups]
        self._sp_ranges = [group.owned_ranges(lambda p: getattr(p, "sequence_parallel", False))
                           for group in self.groups]
        self._runs = [group_runs(group, self._group_index) for group in self.groups]
        self.onebit = OneBitAdam(self.groups, spec.freeze_step, spec.bias_correction, self.device) \
            if spec.type == "onebit_adam" else None
        self.gatherer = None
        if stage == 3 and units:
            self.gatherer = Stage3Gatherer(units, [group for group in self.groups if group.shard_params], prefetch_bucket_size)
        self.unit_ends = None  # data_dependent_graph: see the class docstring
        if data_dependent_graph and stage >= 2 and units:
            self.unit_ends = UnitEnds(units, [group for group in self.groups if not group.full_grads],
                                      self._unit_backward_ended)
        # The step needs the global norm on the host (one synchronisation) only to clip, to back off a
        # dynamic loss scale or to check for inf/NaN; otherwise it stays a device tensor until read.
        self._norm_on_host = self.clip > 0 or self.scaler.dynamic or nonfinite != "ignore"
        # With nothing global to wait for (no clipping, no check, no loss scale), an offloaded bucket's
        # update needs only its own reduced gradient: CPU Adam runs bucket by bucket in one worker
        # thread while backward goes on (stages 1-3 with overlap_comm, at the step's last micro-batch).
        if offload_optimizer and overlap_comm and not self._norm_on_host and self.scaler.scale == 1.0:
            self._early = EarlyUpdates(self, self._sp_ranges)
        self._flattened = True

    def add_param_group(self, param_group: dict) -> None:
        """Only during construction: the flat buffers are laid out once, so a group added later
        could never be updated (see `param_groups.checked_group` for the rules a group obeys)."""
        if getattr(self, "_flattened", False):
            raise NotImplementedError("ZeroOptimizer.add_param_group: the parameters are flattened when the optimizer "
                                      "is built; pass every parameter group to megazero.initialize (model_parameters)")
        self.param_groups.append(checked_group(param_group, self.param_groups, self.defaults))

    # -- set-up ---------------------------------------------------------------------------------
    def _counted_ranges(self, group: FlatGroup, every_dp_rank: bool = False) -> list[list[tuple[int, int]]]:
        """Per bucket, local ranges of the owned slice that count in the global gradient norm:
        each parameter exactly once over its group's dp (stage 0: its rank 0; experts: the expert-data-
        parallel group, each ep rank counting its own experts), tp (replicated: tp rank 0) and pp (tied
        copies: first stage). `every_dp_rank`: at stage 0 every dp rank counts its own (1-bit Adam's
        unreduced gradients)."""
        pctx = self.pctx
        if (group.stage == 0 and group.dp.rank != 0 and not every_dp_rank) or \
                (group.name == "tied" and not pctx.is_first_stage):
            return [[] for _ in group.layout.buckets]
        return group.owned_ranges(lambda p: getattr(p, "tp_dim", None) is not None or pctx.tp_rank == 0)

    # -- micro-batch hooks ------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler.scale != 1.0 else loss

    def set_last_microbatch(self, last: bool) -> None:
        """Tell stages 0-1 whether the coming backward is the step's last (overlap launches then)."""
        self.last_microbatch = last

    @contextlib.contextmanager
    def own_backward(self):
        """The module engine's backward runs inside: with `own_backward_only`, only gradients computed here
        go into the flat buffers. A gradient a parameter already holds in `p.grad` when it begins (from a
        backward outside, or written by the user) joins this backward's: PyTorch would accumulate into it
        (stages 2-3: into its bucket, reduced with this micro-batch's). One still in `p.grad` at the step
        joins there (`_take_outside_grads`). Local: no communication; a loop over the parameters on the host.
        With overlap_comm, stages 0-1 reduce during the step's last backward: a second backward at the
        boundary, before the step, would add into buckets already reduced, and is refused on every rank
        alike (by count, not by which buckets this rank's data completed)."""
        if self._overlapping_now():
            if self._boundary_backward:
                raise RuntimeError(f"engine.backward: a second backward at the accumulation boundary before the step; "
                                   f"ZeRO stage {self.stage} with overlap_comm launches the step's gradient reductions "
                                   f"during the first (a later backward would add into buckets already reduced). Call "
                                   f"backward once per micro-batch (e.g. engine.backward(loss_a + loss_b)) or set "
                                   f"zero_optimization.overlap_comm false")
            self._boundary_backward = True
        if self.unit_ends is not None:  # a backward outside may have ended units: this one starts afresh
            self.unit_ends.reset()
        if self.gatherer is not None:  # stage 3: units a backward outside gathered and never released
            self.gatherer.release_all()
        for group, i, p in self._outside_grads():
            self._absorb(group, i, p)
        self._in_own_backward = True
        try:
            yield
        finally:
            self._in_own_backward = False

    def _overlapping_now(self) -> bool:
        """Whether the coming backward launches stage 0-1 reductions as buckets complete (`_grad_finished`)."""
        return self.overlap and self.last_microbatch and not self.compressing and any(g.full_grads for g in self.groups)

    def _outside_grads(self) -> list[tuple[FlatGroup, int, torch.nn.Parameter]]:
        """(group, index, parameter) of every parameter holding a gradient in `p.grad` (put there outside
        `own_backward`)."""
        return [(group, i, p) for group in self.groups for i, p in enumerate(group.params) if p.grad is not None]

    @torch.no_grad()
    def _absorb(self, group: FlatGroup, i: int, p: torch.nn.Parameter) -> None:
        """Add p.grad, scaled by the loss scale as the engine's own gradients are, into its fp32 slot, and
        drop it. Counts nothing: its bucket is reduced with the rest of the micro-batch's (stages 2-3) or
        step's (0-1)."""
        grad, p.grad = p.grad, None
        group.grad_view(i).view(group.shapes[i]).add_(grad.reshape(group.shapes[i]), alpha=self.scaler.scale)

    def _take_outside_grads(self) -> None:
        """At the step: gradients that reached `p.grad` after the step's last `own_backward` (a backward
        outside, a `p.grad` write) join the step's gradient at stages 0-1 (their buckets reduce now). Stages
        2-3 reduced every bucket inside the backward, and an extra reduction here would have to be agreed
        by every dp rank: refused, with what to do instead."""
        for group, i, p in self._outside_grads():
            if not group.full_grads or self._boundary_backward:  # the latter: every rank alike, by count
                where = getattr(p, "logical_name", None) or f"parameter {i} of flat group {group.name!r} {tuple(group.shapes[i])}"
                why = (f"ZeRO stage {self.stage} reduce-scatters each micro-batch's gradients inside engine.backward"
                       if not group.full_grads else "with overlap_comm it reduces them during the last engine.backward")
                raise RuntimeError(f"engine.step(): {where} holds a gradient in p.grad that came after the last "
                                   f"engine.backward (a backward outside the engine, or a p.grad write); {why}, so it "
                                   f"cannot join this step. Clear it (module.zero_grad()) before engine.step(), or "
                                   f"compute it before engine.backward (it then joins that backward's gradient)")
            self._absorb(group, i, p)

    @torch.no_grad()
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        """Autograd's hook: add p.grad into its slot and drop it before the bucket's reduction
        launches (so the peak does not hold autograd's gradient and the reduction at once). With
        `own_backward_only`, outside `own_backward` it leaves p.grad as it is."""
        if self.own_backward_only and not self._in_own_backward:
            return
        grad, p.grad = p.grad, None
        group, i = self._where[id(p)]
        group.grad_view(i).view(group.shapes[i]).add_(grad.reshape(group.shapes[i]))
        del grad
        self._grad_finished(group, i)

    def accumulate_grad(self, p: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Add one micro-batch's gradient of `p` (what autograd's hook does) and launch the bucket's
        reduction when the bucket is complete."""
        self.accumulate_grad_into(p, lambda slot: slot.add_(grad.reshape(slot.shape)))

    @torch.no_grad()
    def accumulate_grad_into(self, p: torch.nn.Parameter, add_into) -> None:
        """``add_into(slot)`` adds `p`'s whole micro-batch gradient into its fp32 accumulation slot,
        shaped like `p` (zero-bubble W runs its weight GEMM straight into it); then the bucket's
        reduction is launched if the bucket is complete. Runs without autograd: a gradient handed in
        with history must not make the flat buffers part of a graph."""
        group, i = self._where[id(p)]
        add_into(group.grad_view(i).view(group.shapes[i]))
        self._grad_finished(group, i)

    def _grad_finished(self, group: FlatGroup, i: int) -> None:
        """Parameter i of `group` has its micro-batch gradient in its slot: launch its bucket's
        reduction if the bucket is complete."""
        done = group.grad_done(i)
        if done is None:
            return
        # Stages 2-3 reduce-scatter a bucket as soon as it is complete and its turn has come
        # (asynchronously with overlap_comm), so only the buckets being filled hold full-size gradients
        # (with a data-dependent graph at the end of its unit's backward instead: `_unit_backward_ended`);
        # stages 0-1 keep full gradients anyway and reduce at the step's last micro-batch, here only
        # when overlapping.
        if not group.full_grads:
            if self.unit_ends is None:
                group.bucket_ready(done, async_op=self.overlap)
        elif self.overlap and self.last_microbatch and not self.compressing:
            group.bucket_ready(done, async_op=True)
        if self.gatherer is not None and group.shard_params:
            self.gatherer.bucket_done(group, done)

    def _unit_backward_ended(self, u: int, through) -> None:
        """Stages 2-3 with `data_dependent_graph` (`UnitEnds`' callback): unit u's backward ended; launch each
        group's buckets up to its b in `through`, complete or not, over the group's dp group (at stage 3
        before any earlier unit's gathers), and release the unit. (Not for megazero's pipelines: their graph
        is fixed, and zero-bubble schedules add weight gradients after a unit's backward.) In a backward
        outside `own_backward` (with `own_backward_only`) it only releases the unit: no gradient was taken."""
        if not self.own_backward_only or self._in_own_backward:
            for group, b in through:
                group.launch_through(b, async_op=self.overlap, complete_or_not=True)
        if self.gatherer is not None:
            self.gatherer.backward_ended(u)

    def _bucket_reduced(self, group: FlatGroup, b: int) -> None:
        """A flat group's bucket reduction landed (its `on_reduced`): an early update may start."""
        if self._early is not None:
            self._early.bucket_reduced(group, b)

    def after_backward(self) -> None:
        """End of one micro-batch's backward: stages 2-3 reduce-scatter every bucket not launched yet
        (`FlatGroup.flush`: in index order, an empty one as zeros, so every dp rank issues the same
        reductions whatever its graph used), stage 3 releases every gathered parameter."""
        for group in self.groups:
            if not group.full_grads:
                group.flush()
            elif not self.last_microbatch or not self.overlap:
                group.reset_pending()
        if self.gatherer is not None:
            self.gatherer.release_all()
        if self.unit_ends is not None:
            self.unit_ends.reset()
            for group in self.groups:  # a unit's buckets were alive at once: keep only a steady backward's
                group.slots.trim(FlatGroup.MAX_INFLIGHT + 1)

    # -- the step -----------------------------------------------------------------------------------
    def reduce_grads(self) -> None:
        """Stages 0-1: reduce every bucket not reduced yet, in index order (`FlatGroup.flush`); all: sum
        tied shards over the embedding group; wait for everything in flight. Idempotent within a step."""
        if self._reduced:
            return
        if self.own_backward_only:
            self._take_outside_grads()
        self._reduced = True
        if self.gatherer is not None:  # stage 3: units a backward outside gathered would go stale
            self.gatherer.release_all()
        for group in self.groups:
            if group.full_grads and not self.compressing:  # 1-bit Adam: each rank keeps its own gradient
                group.flush(async_op=self.overlap)
            group.wait()
            group.reset_pending()
            if group.name == "tied":
                for t in group.grad_owned:
                    comm.all_reduce(t, self.pctx.embedding_group)
        self._sum_sequence_parallel_grads()

    def _sum_sequence_parallel_grads(self) -> None:
        """Sequence-parallel parameters (norms on sequence shards) get partial gradients on each TP
        rank: sum their owned slices over pctx.tp_group in one flat all-reduce (TP ranks share the
        flat layout, so the slices line up)."""
        views = [t[a:e] for group, per_bucket in zip(self.groups, self._sp_ranges)
                 for t, ranges in zip(group.grad_owned, per_bucket) for a, e in ranges]
        if not views or self.pctx.tp_size == 1:
            return
        flat = torch.cat(views)
        comm.all_reduce(flat, self.pctx.tp_group)
        pos = 0
        for v in views:
            v.copy_(flat[pos:pos + v.numel()])
            pos += v.numel()

    def _all_owned_grads(self):
        return [t for group in self.groups for t in group.grad_owned]

    def global_grad_norm(self) -> float:
        """L2 norm of the full model's gradient, every parameter counted once, over pctx.world_group
        (one all-reduce and one host synchronisation)."""
        return float(self._squared_norm().sqrt().item())

    def _squared_norm(self) -> torch.Tensor:
        """The squared global gradient norm as a (1,) fp64 tensor on the optimizer's device, all-reduced
        over pctx.world_group: one fused pass (`torch._foreach_norm`: one multi-tensor kernel on CUDA)
        over this rank's counted ranges, no host synchronisation. Each range's norm accumulates in
        fp64 (no fp64 copy of the gradients is made): an fp32 norm's error grows with the range's length
        without cascade summation (torch's CPU kernel: 3e-5 relative at 1M elements), and the ranges
        differ by layout, so an fp32 norm would differ between layouts of the same run."""
        counted = self._counted_own if self.compressing else self._counted
        views = [t[a:e] for group, per_group in zip(self.groups, counted)
                 for t, ranges in zip(group.grad_owned, per_group) for a, e in ranges]
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        if views:  # the gradient shards live on the optimizer's device, offloaded or not
            sq += torch.stack(torch._foreach_norm(views, 2, dtype=torch.float64)).square().sum()  # fp64 per range
        comm.all_reduce(sq, self.pctx.world_group)
        if self.compressing:  # unreduced gradients: the mean over dp of each rank's own squared norm (an
            sq /= self.pctx.dp_cp_group.size  # inf or NaN on any rank makes it non-finite everywhere)
        return sq

    @property
    def compressing(self) -> bool:
        """1-bit Adam past its warm-up (the step being taken is after `freeze_step`): gradients stay
        unreduced; the momentum is averaged in 1 bit (`megazero.zero.onebit`)."""
        return self.onebit is not None and self.onebit.compressing(self.step_count)

    def _update_all(self, coef: float) -> None:
        """Update every flat group (the buckets an early update did not take) and publish the new
        parameters (all-gathers over each group's dp)."""
        done = self._early.finish() if self._early is not None else {}
        for g, (group, runs) in enumerate(zip(self.groups, self._runs)):
            left = [b for b in range(len(runs)) if (g, b) not in done]
            if left:
                self._update_group(group, runs, coef, left)
            group.publish_master(self.allgather_bucket_size)

    def at_step_end(self, applied: int) -> bool:
        """Whether this rank's parameters and optimizer states are exactly those after `applied` steps (counted as
        `step_count + skipped_steps`): no update begun since, including an offloaded early update. Local."""
        early = self._early is not None and self._early.pending()
        return not self.updating and not early and self.step_count + self.skipped_steps == applied

    def skip_step(self) -> dict:
        """Drop this step's gradients unapplied and count the step skipped, as a non-finite step is; for a
        caller that decided on every rank alike (the silent-error check). `step`'s dict. Local."""
        self.skipped_steps += 1
        self.zero_grad()
        return {"loss_scale": self.scaler.scale, "lr": self.param_groups[0]["lr"], "skipped": True,
                "grad_norm": float("nan"), "skipped_steps": self.skipped_steps}

    def step(self) -> dict:
        """Reduce, unscale, agree on non-finite gradients, clip and update. Returns {"skipped",
        "grad_norm", "loss_scale", "lr", "skipped_steps"}; "grad_norm" is a float, or, when the step
        needs no norm on the host (no clipping, ``nonfinite="ignore"``, no dynamic loss scale), a 0-d
        tensor on the device that synchronises only when read (`float()`): then the step never waits
        for the device.

        Every precision checks for inf/NaN in the reduced gradients through the global norm: an inf or
        NaN anywhere makes the all-reduced sum of squares non-finite on every rank, so the ranks agree
        without a collective of their own. Then a dynamic loss scale backs off, and the step is skipped
        and counted (``nonfinite="skip"``) or every rank raises `NonFiniteGradients` naming the step
        and the first non-finite parameter it holds (``nonfinite="error"``)."""
        self.reduce_grads()
        scale = self.scaler.scale
        if scale != 1.0:
            for t in self._all_owned_grads():
                t.mul_(1.0 / scale)
        info = {"loss_scale": scale, "lr": self.param_groups[0]["lr"]}
        if not self._norm_on_host:  # no host synchronisation: the norm is read when someone reads it
            norm = self._squared_norm().sqrt()[0]  # 0-d; float(norm) synchronises
            self.step_count += 1
            self.updating = True  # stays True if the update fails half way
            self._update_all(1.0)
            self.updating = False
            self._zero_flat_grads()
            return info | {"skipped": False, "grad_norm": norm, "skipped_steps": self.skipped_steps}
        norm = self.global_grad_norm()
        if not math.isfinite(norm):
            if self.scaler.dynamic:
                self.scaler.update(True)
            elif self.nonfinite == "error":
                first = views.first_nonfinite(self)
                where = f"first on this rank: {first}" if first else "on another rank"
                raise NonFiniteGradients(f"step {self.step_count + 1}: non-finite gradients ({where}); "
                                         f"nonfinite_gradients=skip skips such steps instead")
            self.skipped_steps += 1
            self._zero_flat_grads()
            return info | {"skipped": True, "grad_norm": float("nan"), "skipped_steps": self.skipped_steps}
        coef = min(1.0, self.clip / (norm + 1e-6)) if self.clip > 0 else 1.0
        self.step_count += 1
        self.updating = True  # stays True if the update fails half way
        self._update_all(coef)
        self.updating = False
        self._zero_flat_grads()
        self.scaler.update(False)
        return info | {"skipped": False, "grad_norm": norm, "skipped_steps": self.skipped_steps}

    def _update_group(self, group: FlatGroup, runs, coef: float, buckets, grads=None, step: int | None = None) -> None:
        """The update of every run of `group`'s `buckets` with its parameter group's hyper-parameters,
        read now: ONE multi-tensor Adam call for them all (per-run lr and weight decay go inside the
        call; one call per distinct betas/eps, normally one), on the offloaded host copy if offloaded
        (`grads`: the host copies of those buckets, when the caller made them; `step`: the Adam step,
        by default `step_count`)."""
        s, step = self.spec, step or self.step_count
        if grads is None:  # offloaded: copied into pinned memory, one synchronisation
            grads = dict(zip(buckets, group.host_grads(buckets)))
        if coef != 1.0:
            torch._foreach_mul_([grads[b] for b in buckets], coef)  # clipping, in place: zeroed after the step
        if self.onebit is not None:
            self.onebit.update(group, runs, buckets, grads, step, self.param_groups)
            return
        calls: dict[tuple[float, float, float], tuple[list, ...]] = {}  # (beta1, beta2, eps) -> the lists
        for b in buckets:
            for a, e, g in runs[b]:
                h = self.param_groups[g]
                p, gr, m, v = group.master[b][a:e], grads[b][a:e], group.exp_avg[b][a:e], group.exp_avg_sq[b][a:e]
                if s.type == "sgd":
                    sgd_step(p, gr, m, h["lr"], h["momentum"], h["weight_decay"], first=step == 1)
                    continue
                lists = calls.setdefault((*h["betas"], h["eps"]), ([], [], [], [], [], []))
                for lst, item in zip(lists, (p, gr, m, v, h["lr"], h["weight_decay"])):
                    lst.append(item)
        for (beta1, beta2, eps), (ps, gs, ms, vs, lrs, wds) in calls.items():
            kernels.adam_step(ps, gs, ms, vs, step=step, lr=lrs, beta1=beta1, beta2=beta2, eps=eps,
                              weight_decay=wds, adamw_mode=s.type == "adamw", bias_correction=s.bias_correction)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated so far, as torch's `Optimizer.zero_grad`: the flat buffers' and
        whatever the parameters hold in `p.grad` (set to None, or zeroed in place with
        `set_to_none=False`). Local: no communication (a reduction in flight is waited for)."""
        for group in self.groups:
            for p in group.params:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:  # as torch's Optimizer.zero_grad
                        if p.grad.grad_fn is not None:
                            p.grad.detach_()
                        else:
                            p.grad.requires_grad_(False)
                        p.grad.zero_()
        self._zero_flat_grads()

    def _zero_flat_grads(self) -> None:
        """Drop the flat buffers' gradients (the step's end; `zero_grad`)."""
        self._reduced = False
        self._boundary_backward = False
        if self._early is not None:  # an early update already applied stays applied (see offload_overlap)
            self._early.finish()
        for group in self.groups:
            group.zero_grads()

    # -- introspection ----------------------------------------------------------------------------
    def full_parameters(self, writeback: bool = False, params=None, modifier_rank: int | None = None):
        """Context manager: see `megazero.zero.views.full_parameters` (all-gathers over dp at stage 3)."""
        return views.full_parameters(self, writeback, params, modifier_rank)

    def state_dict(self) -> dict:
        """This rank's optimizer state (layout-specific): master shard, moments, step, scaler."""
        return {"step_count": self.step_count, "scaler": self.scaler.state_dict(), "param_groups": self.hyperparameters(),
                "groups": [{"name": group.name, "numel": group.layout.total, "master": [m.detach().clone() for m in group.master],
                            "state": group.state_flat.detach().clone()} for group in self.groups],
                "rank": self.rank_state()}

    def load_state_dict(self, sd: dict) -> None:
        """Restore `state_dict()` from the same layout (same groups and sizes) and republish the
        working parameters from the master."""
        mine = [(group.name, group.layout.total) for group in self.groups]
        theirs = [(saved["name"], saved["numel"]) for saved in sd["groups"]]
        if mine != theirs:
            raise ValueError(f"optimizer state was saved for flat groups {theirs}, this layout has {mine}")
        self.step_count = sd["step_count"]
        self.scaler.load_state_dict(sd["scaler"])
        self.load_hyperparameters(sd["param_groups"])
        for group, saved in zip(self.groups, sd["groups"]):
            for m, src in zip(group.master, saved["master"]):
                m.copy_(src)
            group.state_flat.copy_(saved["state"])
            group.publish_master(self.allgather_bucket_size)
        self.load_rank_state(sd.get("rank", {}))

    def rank_state(self) -> dict[str, torch.Tensor]:
        """State of this rank's own that no other layout could use, as {key: copy}: 1-bit Adam's error
        feedback (`OneBitAdam.state`); empty otherwise."""
        return self.onebit.state() if self.onebit is not None else {}

    def load_rank_state(self, saved: dict[str, torch.Tensor]) -> None:
        """Restore what `rank_state()` saved in the same layout (`OneBitAdam.load_state`)."""
        if self.onebit is not None:
            self.onebit.load_state(saved)

    def hyperparameters(self) -> list[dict]:
        """Each parameter group's settings without its parameters, for checkpoints."""
        return hyperparameters(self.param_groups)

    def load_hyperparameters(self, saved: list[dict]) -> None:
        """Restore `hyperparameters()` into the same number of parameter groups."""
        load_hyperparameters(self.param_groups, saved)

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds right now: params, grads, master, optimizer_states (1-bit Adam's worker and
        server errors included: 4·(P + P/dp) bytes per bucket of P elements, P padded to 8·dp), comm_buffers,
        grad_buckets (the flat groups' fp32 bucket slots, made once and kept: `flat_group.SlotPool`)."""
        total: dict[str, int] = {}
        for group in self.groups:
            for k, v in group.memory().items():
                total[k] = total.get(k, 0) + v
        if self.onebit is not None:  # its error feedback
            total["optimizer_states"] = total.get("optimizer_states", 0) + self.onebit.error_bytes()
        return total

    def reduced_gradients(self) -> dict:
        """{parameter: its reduced fp32 gradient}: see `megazero.zero.views.reduced_gradients`."""
        return views.reduced_gradients(self)

    def num_params(self) -> int:
        return sum(n for group in self.groups for n in group.layout.numels)
