"""DeepSpeed's engine accessors, shared by both engines: modes, learning rates, batch sizes, the
last step's gradient norm, where the engine runs, its precision, ZeRO stage and sizes. An engine has
`module`, `optimizer`, `pctx`, `micro_batch_size`, `local_rank`, `device`, `last_info`, `global_steps`
`gradient_accumulation_steps()` and `monitor` (DeepSpeed's MonitorMaster, or None). DeepSpeed's attributes `global_rank`, `world_size`,
`dp_world_size`, `mp_world_size` (its model-parallel size: the tensor-parallel one) and
`global_samples` are read-only properties here, and `grid` (DeepSpeed's PipelineParallelGrid) is
read off the ParallelContext."""
from __future__ import annotations

import torch

from megazero.compat.pipe_topology import PipelineParallelGrid


class EngineSurface:
    def train(self, mode: bool = True):
        """The module's training mode (dropout on), as `nn.Module.train`; returns the engine."""
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def zero_grad(self) -> None:
        """Drop the gradients accumulated so far (the ZeRO optimizer's flat buffers)."""
        self.optimizer.zero_grad()

    def get_lr(self) -> list[float]:
        """The learning rate of each parameter group, as the next step will use it."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The last step's global gradient norm before clipping (None before the first step); reading
        it synchronises with the device when the step left it there (``nonfinite_gradients=ignore``)."""
        norm = self.last_info.get("grad_norm")
        return None if norm is None else float(norm)

    @property
    def grid(self) -> PipelineParallelGrid:
        """DeepSpeed's `engine.grid`: this rank's pp / dp / tp ranks, sizes and torch process groups."""
        return PipelineParallelGrid(self.pctx)

    global_rank = property(lambda self: self.pctx.global_rank)
    world_size = property(lambda self: self.pctx.topology.world_size)
    dp_world_size = property(lambda self: self.pctx.dp_size)
    mp_world_size = property(lambda self: self.pctx.tp_size)

    @property
    def global_samples(self) -> int:
        """Samples trained so far: steps x the global batch (DeepSpeed counts the same)."""
        return self.global_steps * self.train_batch_size()

    def _monitor_step(self, loss, loss_samples: int) -> None:
        """After an optimizer step, with `engine.monitor` on: DeepSpeed's per-step events on global rank 0,
        the mean loss at `loss_samples`, the lr (and fp16's loss scale) at `global_samples`. Reads the
        loss on the host: one synchronisation per step, only while a monitor is on."""
        if self.monitor is None or not self.monitor.enabled or self.pctx.global_rank != 0:
            return
        events = [("Train/Samples/train_loss", float(loss), loss_samples),
                  ("Train/Samples/lr", self.get_lr()[0], self.global_samples)]
        if self.fp16_enabled():
            events.append(("Train/Samples/loss_scale", float(self.optimizer.scaler.scale), self.global_samples))
        self.monitor.write_events(events)

    def _working_dtype(self) -> torch.dtype:
        return next((p.dtype for p in self.module.parameters() if p.is_floating_point()), torch.float32)

    def fp16_enabled(self) -> bool:
        """Whether the module trains in fp16 (``precision: fp16``, DeepSpeed's fp16.enabled)."""
        return self._working_dtype() == torch.float16

    def bfloat16_enabled(self) -> bool:
        """Whether the module trains in bf16 (``precision: bf16``, DeepSpeed's bf16.enabled)."""
        return self._working_dtype() == torch.bfloat16

    def zero_optimization_stage(self) -> int:
        return self.optimizer.stage

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.micro_batch_size

    def train_batch_size(self) -> int:
        """The global batch: micro-batch x gradient accumulation x data-parallel size."""
        return self.micro_batch_size * self.gradient_accumulation_steps() * self.pctx.dp_size
