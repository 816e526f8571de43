"""ModuleEngine: DeepSpeed's `engine(batch)`, `engine.backward(loss)`, `engine.step()` for any
nn.Module with tp = pp = 1 (a Hugging Face model, a user's own), ZeRO 0-3 and offload included.

`step()` is called after every micro-batch, as with DeepSpeed; it steps the optimizer and the LR
schedule only at the gradient-accumulation boundary. `backward(loss)` divides the loss by
gradient_accumulation_steps and applies the loss scale. Gradient reduction happens over
pctx.dp_group inside the ZeRO optimizer.
"""
from __future__ import annotations

import contextlib

import torch

from megazero.compat.flops_profiler import FlopsProfiler
from megazero.data.repeating import RepeatingLoader
from megazero.engine.checkpointing import CheckpointMethods
from megazero.engine.surface import EngineSurface
from megazero.moe.layer import set_aux_loss_scale
from megazero.pipeline.executor import to_device
from megazero.runtime import comm
from megazero.runtime.parallel_context import ParallelContext
from megazero.zero.lr_schedule import step_lr_scheduler


class ModuleEngine(CheckpointMethods, EngineSurface):
    def __init__(self, module, pctx: ParallelContext, optimizer, lr_scheduler, gradient_accumulation_steps: int,
                 micro_batch_size: int = 1, local_rank: int = 0, device="cpu", training_data=None, monitor=None,
                 flops_profiler=None, config=None):
        self.module, self.pctx, self.optimizer, self.lr_scheduler = module, pctx, optimizer, lr_scheduler
        self.config = config  # the resolved Config it was built from (None when built by hand)
        # DeepSpeed's engine.monitor (megazero.compat.monitor.MonitorMaster) and flops_profiler section
        self.monitor, self.flops_profiler_config = monitor, flops_profiler
        self._step_loss = None  # the step's summed micro-batch losses, kept only while a monitor is on
        # DeepSpeed's train_batch() without an iterator reads initialize(training_data=...)'s loader, endlessly;
        # made at the first such call: a DataLoader's iterator draws its seed from torch's generator, which
        # DeepSpeed's (non-pipeline) engine and PyTorch leave alone until the script iterates
        self.training_data, self.training_iter = training_data, None
        self.gas, self.micro_batch_size = gradient_accumulation_steps, micro_batch_size
        self.local_rank, self.device = local_rank, torch.device(device)
        self.syncing = True  # False inside no_sync()
        self.boundary_override: bool | None = None  # set_gradient_accumulation_boundary's, else counted
        self.micro_steps = 0
        self.global_steps = 0
        self.pending_save = None  # the asynchronous checkpoint save in flight (engine/checkpointing.py)
        self.last_info: dict = {}

    def __call__(self, *args, **kwargs):
        f = self.flops_profiler_config
        if f is None or not f.enabled or self.global_steps != f.profile_step or self.micro_steps % self.gas \
                or self.pctx.global_rank != 0:
            return self.module(*args, **kwargs)
        # DeepSpeed's flops profiler: the first forward of step `profile_step` (completed steps), rank 0
        prof = FlopsProfiler(self.module, recompute_fwd_factor=f.recompute_fwd_factor)
        prof.start_profile()
        try:
            return self.module(*args, **kwargs)
        finally:
            prof.stop_profile()
            prof.print_model_profile(f.profile_step, f.module_depth, f.top_modules, f.detailed, f.output_file)

    forward = __call__

    def gradient_accumulation_steps(self) -> int:
        return self.gas

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next `step()` steps the optimizer: every gas-th micro-batch, or what
        `set_gradient_accumulation_boundary` said."""
        if self.boundary_override is not None:
            return self.syncing and self.boundary_override
        return self.syncing and (self.micro_steps + 1) % self.gas == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's manual override of the accumulation boundary (for scripts that decide it, e.g.
        with variable accumulation): until changed, `step()` steps the optimizer only when True."""
        self.boundary_override = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients without reducing them and without counting
        towards the accumulation boundary, as DeepSpeed's: `step()` inside is an error. ZeRO-2 and -3
        reduce-scatter every micro-batch's gradients (that is how they save memory), so, as in
        DeepSpeed, they refuse it."""
        if self.optimizer.stage >= 2:
            raise RuntimeError(f"engine.no_sync(): not compatible with ZeRO stage {self.optimizer.stage}, which "
                               "reduce-scatters every micro-batch's gradients; use stage 0 or 1")
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of one micro-batch's loss, divided by gradient_accumulation_steps (unless
        `scale_wrt_gas` is False) and scaled by the loss scale; returns the loss so divided, as DeepSpeed's.
        `retain_graph` keeps the graph for another backward through it. May be called more than once per
        micro-batch (a GAN's discriminator: real and fake losses); the gradients add up. Only this
        backward's gradients go into the optimizer's flat buffers: those another engine's backward or a
        `loss.backward()` of the user's leave on the module's parameters stay in `p.grad`, as in PyTorch
        (`ZeroOptimizer.own_backward`)."""
        self.optimizer.set_last_microbatch(self.is_gradient_accumulation_boundary())
        divisor = self.gas if scale_wrt_gas else 1
        set_aux_loss_scale(self.module, self.optimizer.scaler.scale / divisor)  # MoE layers' aux losses, as the loss
        loss = loss / divisor
        with self.optimizer.own_backward():
            self.optimizer.scale_loss(loss).backward(retain_graph=retain_graph)
        self.optimizer.after_backward()
        if self.monitor is not None and self.monitor.enabled:  # the step's mean loss: the sum of loss / gas
            self._step_loss = loss.detach() if self._step_loss is None else self._step_loss + loss.detach()
        return loss

    def step(self) -> None:
        """Call after every micro-batch: steps the optimizer at the accumulation boundary."""
        if not self.syncing:
            raise RuntimeError("engine.step() inside engine.no_sync(): leave the context first, as in DeepSpeed")
        if self.is_gradient_accumulation_boundary():
            self.last_info = self.optimizer.step()
            if self.lr_scheduler is not None and not self.last_info.get("skipped", False):
                step_lr_scheduler(self.lr_scheduler)
            samples, self.global_steps = self.global_samples, self.global_steps + 1
            if self._step_loss is not None:  # DeepSpeed writes the loss at the samples before the step
                self._monitor_step(self._step_loss, samples)
                self._step_loss = None
        self.micro_steps += 1

    def _loss(self, batch, loss_fn) -> torch.Tensor:
        """One micro-batch's loss: `loss_fn(module, batch)`, or the module's output (a tensor, or an
        object with `.loss`) for a dict batch (keyword arguments) or a tuple/list (positional)."""
        if loss_fn is not None:
            out = loss_fn(self.module, batch)
        elif isinstance(batch, dict):
            out = self.module(**batch)
        else:
            out = self.module(*batch)
        return out if isinstance(out, torch.Tensor) else out.loss

    def _mean_over_dp(self, total: torch.Tensor) -> torch.Tensor:
        """The mean loss, 0-d fp64 on the device: `total` (the sum over micro-batches) all-reduced over
        pctx.dp_group, divided by micro-batches x dp. No host synchronisation."""
        comm.all_reduce(total, self.pctx.dp_group)
        return (total / (self.gas * self.pctx.dp_size))[0]

    def _batches(self, data_iter):
        """`data_iter`, or initialize(training_data=...)'s loader; each batch moved to the engine's device
        (DeepSpeed's loader yields host tensors; the module's parameters are on the device)."""
        if data_iter is None and self.training_data is None:
            raise ValueError("train_batch(data_iter=None): pass an iterator of batches, or give "
                             "megazero.initialize(training_data=...) a dataset")
        if data_iter is None and self.training_iter is None:
            self.training_iter = iter(RepeatingLoader(self.training_data))
        source = data_iter if data_iter is not None else self.training_iter
        return (to_device(next(source), self.device) for _ in range(self.gas))

    def train_step(self, data_iter=None, loss_fn=None) -> torch.Tensor:
        """gas micro-batches of forward/backward and one step (see `_loss` for what a batch may be);
        the mean loss over the micro-batches and dp as a 0-d device tensor (no host synchronisation:
        the trainer reads it when it logs)."""
        self.module.train()
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for batch in self._batches(data_iter):
            loss = self._loss(batch, loss_fn)
            self.backward(loss)
            self.step()
            total += loss.detach().double()
        return self._mean_over_dp(total)

    def train_batch(self, data_iter=None, loss_fn=None) -> float:
        """`train_step`, its mean loss read on the host (one synchronisation)."""
        return float(self.train_step(data_iter, loss_fn))

    @torch.no_grad()
    def eval_batch(self, data_iter=None, loss_fn=None) -> float:
        """gas micro-batches of forward only, in eval mode; the mean loss over them and dp (an
        all-reduce over pctx.dp_group)."""
        self.module.eval()
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for batch in self._batches(data_iter):
            total += self._loss(batch, loss_fn).detach().double()
        return float(self._mean_over_dp(total))
