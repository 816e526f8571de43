"""PipelineEngine: `train_batch(data_iter)` / `eval_batch(data_iter)` for a PipelineModule.

One call runs one global step of this stage's schedule program: it pulls
`num_microbatches` (= gradient_accumulation_steps) micro-batches on the stages that need data,
lets the executor run the program (p2p over the pp group, ZeRO over dp, TP inside the layers),
steps the LR schedule, and returns the mean loss on EVERY rank: the last stage's mean over
micro-batches is averaged over dp (all-reduce on dp_group) and broadcast from the last stage over
pp_group. With one stage this is plain gradient accumulation.
"""
from __future__ import annotations

import torch

from megazero.runtime import comm
from megazero.core import instructions as I
from megazero.pipeline.executor import PipelineExecutor
from megazero.pipeline.p2p import PipeP2P
from megazero.core.schedules import get_schedule
from megazero.tensor_parallel.weight_grad import WeightGradStore
from megazero.tensor_parallel.weight_grad import attach as attach_wgrad_store


def forward_only_program(num_stages: int, num_microbatches: int, stage: int, chunks: int = 1):
    """Evaluation program: each micro-batch passes through every virtual stage in turn (forward
    only, activations sent downstream); one micro-batch in flight, so blocking p2p cannot deadlock."""
    last = num_stages * chunks - 1
    prog = []
    for mb in range(num_microbatches):
        if stage == 0 or stage == last % num_stages:
            prog.append(I.LoadMicroBatch(mb))
        for c in range(chunks):
            vs = I.virtual_stage(stage, c, num_stages)
            if vs > 0:
                prog.append(I.RecvAct(mb, c, (stage - 1) % num_stages))
            prog.append(I.Forward(mb, c))
            if vs < last:
                prog.append(I.SendAct(mb, c, (stage + 1) % num_stages))
    return tuple(prog)


class PipelineEngine:
    """Trains a PipelineModule with a ZeroOptimizer; see the module docstring."""

    def __init__(self, module, ctx, optimizer, lr_scheduler, num_microbatches: int, schedule: str = "1f1b",
                 chunks: int = 1, act_shape=None, dtype=torch.float32, on_instruction=None, device="cpu"):
        self.module, self.ctx, self.optimizer, self.lr_scheduler = module, ctx, optimizer, lr_scheduler
        self.num_microbatches, self.chunks = num_microbatches, chunks
        self.program = get_schedule(schedule, ctx.pp_size, num_microbatches, chunks)[ctx.pp_rank]
        self.eval_program = forward_only_program(ctx.pp_size, num_microbatches, ctx.pp_rank, chunks)
        self.device = torch.device(device)
        self.p2p = PipeP2P(ctx.pp_group, act_shape, dtype, self.device) if ctx.pp_size > 1 else None
        store = None
        if any(isinstance(i, I.BackwardWeight) for i in self.program):  # zero bubble: split B and W
            store = WeightGradStore()
            attach_wgrad_store(module, store)
        self.executor = PipelineExecutor(module, self.p2p, optimizer, ctx.pp_rank, ctx.pp_size,
                                         rank=ctx.global_rank, on_instruction=on_instruction, wgrad_store=store,
                                         device=self.device)
        self.global_steps = 0
        self.last_info: dict = {}

    def needs_data(self) -> bool:
        """Whether this stage loads micro-batches (first and last virtual stage only)."""
        return any(isinstance(i, I.LoadMicroBatch) for i in self.program)

    def train_batch(self, data_iter=None) -> float:
        """One optimizer step over `num_microbatches` micro-batches; the mean loss on every rank."""
        self.module.train()
        st = self.executor.run(self.program, data_iter, self.num_microbatches)
        self.last_info = dict(st.info)
        if self.lr_scheduler is not None and not st.info.get("skipped", False):
            self.lr_scheduler.step()
        self.global_steps += 1
        return self._agree_loss(st.losses)

    @torch.no_grad()
    def eval_batch(self, data_iter=None) -> float:
        """Forward only over `num_microbatches` micro-batches; the mean loss on every rank."""
        self.module.eval()
        st = self.executor.run(self.eval_program, data_iter, self.num_microbatches)
        return self._agree_loss(st.losses)

    def _agree_loss(self, losses) -> float:
        """Mean over micro-batches (last stage), over dp (all-reduce), to every stage (broadcast)."""
        t = torch.zeros(1, dtype=torch.float64, device=self.device)
        if losses:
            t += torch.stack([l.double() for l in losses]).mean()
        comm.all_reduce(t, self.ctx.dp_group)
        t /= self.ctx.dp_size
        comm.broadcast(t, self.ctx.pp_size - 1, self.ctx.pp_group)
        return float(t.item())
