"""ModuleEngine: DeepSpeed's `engine(batch)`, `engine.backward(loss)`, `engine.step()` for any
nn.Module with tp = pp = 1 (a Hugging Face model, a user's own), ZeRO 0-3 and offload included.

`step()` is called after every micro-batch, as with DeepSpeed; it steps the optimizer and the LR
schedule only at the gradient-accumulation boundary. `backward(loss)` divides the loss by
gradient_accumulation_steps and applies the loss scale. Gradient reduction happens over
pctx.dp_group inside the ZeRO optimizer.
"""
from __future__ import annotations

import torch

from megazero.engine.checkpointing import CheckpointMethods
from megazero.runtime import comm
from megazero.runtime.parallel_context import ParallelContext
from megazero.zero.lr_schedule import step_lr_scheduler


class ModuleEngine(CheckpointMethods):
    def __init__(self, module, pctx: ParallelContext, optimizer, lr_scheduler, gradient_accumulation_steps: int):
        self.module, self.pctx, self.optimizer, self.lr_scheduler = module, pctx, optimizer, lr_scheduler
        self.gas = gradient_accumulation_steps
        self.micro_steps = 0
        self.global_steps = 0
        self.pending_save = None  # the asynchronous checkpoint save in flight (engine/checkpointing.py)
        self.last_info: dict = {}

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    forward = __call__

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gas == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss (scaled by 1/gas and the loss scale)."""
        self.optimizer.set_last_microbatch(self.is_gradient_accumulation_boundary())
        self.optimizer.scale_loss(loss / self.gas).backward()
        self.optimizer.after_backward()

    def step(self) -> None:
        """Call after every micro-batch: steps the optimizer at the accumulation boundary."""
        if self.is_gradient_accumulation_boundary():
            self.last_info = self.optimizer.step()
            if self.lr_scheduler is not None and not self.last_info.get("skipped", False):
                step_lr_scheduler(self.lr_scheduler)
            self.global_steps += 1
        self.micro_steps += 1

    def train_batch(self, data_iter, loss_fn=None) -> float:
        """gas micro-batches of forward/backward and one step; `loss_fn(module, batch) -> loss`
        (default: the module returns the loss, or an object with `.loss`). Mean loss over dp."""
        total = torch.zeros(1, dtype=torch.float64, device=self.optimizer.device)
        for _ in range(self.gas):
            batch = next(data_iter)
            out = loss_fn(self.module, batch) if loss_fn else self.module(**batch)
            loss = out if isinstance(out, torch.Tensor) else out.loss
            self.backward(loss)
            self.step()
            total += loss.detach().double()
        comm.all_reduce(total, self.pctx.dp_group)
        return float(total.item()) / (self.gas * self.pctx.dp_size)
