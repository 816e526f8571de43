"""DeepSpeed's engine accessors, shared by both engines: modes, learning rates, batch sizes, the
last step's gradient norm, where the engine runs. An engine has `module`, `optimizer`, `pctx`,
`micro_batch_size`, `local_rank`, `device`, `last_info` and `gradient_accumulation_steps()`."""
from __future__ import annotations


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

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.micro_batch_size

    def train_batch_size(self) -> int:
        """The global batch: micro-batch x gradient accumulation x data-parallel size."""
        return self.micro_batch_size * self.gradient_accumulation_steps() * self.pctx.dp_size
