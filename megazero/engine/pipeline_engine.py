"""PipelineEngine: `train_batch(data_iter)` / `eval_batch(data_iter)` for a PipelineModule.

One call runs one global step of this stage's schedule program: it pulls
`num_microbatches` (= gradient_accumulation_steps) micro-batches on the stages that need data,
lets the executor run the program (p2p over the pp group, ZeRO over dp (x cp), TP and cp inside the layers),
steps the LR schedule, and returns the mean loss on EVERY rank: the last stage's mean over
micro-batches is averaged over dp x cp (all-reduce on dp_cp_group) and broadcast from the last stage over
pp_group. With one stage this is plain gradient accumulation.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.checkpoint.sharded import rng_states, set_rng_states
from megazero.core import instructions as I
from megazero.core.schedules import forward_only, get_schedule, splits_backward, with_loads_everywhere
from megazero.core.simulate import peaks
from megazero.data.repeating import RepeatingLoader
from megazero.engine.checkpointing import CheckpointMethods
from megazero.engine.surface import EngineSurface
from megazero.moe.layer import set_aux_loss_scale
from megazero.moe.stats import step_stats
from megazero.pipeline.executor import PipelineExecutor
from megazero.pipeline.p2p import PipeP2P
from megazero.pipeline.pipeline_module import PipelineModule
from megazero.resilience.silent_check import SilentCheck, SilentError
from megazero.runtime import comm
from megazero.runtime.parallel_context import ParallelContext
from megazero.runtime.stall_watch import StallWatch, limit_for
from megazero.tensor_parallel.weight_grad import WeightGradStore, defer_linears
from megazero.zero.lr_schedule import step_lr_scheduler


def _stall_watch(pctx: ParallelContext) -> StallWatch | None:
    """The executor's stall watch (`megazero.runtime.stall_watch`) when there are peers to wait for."""
    if pctx.topology.world_size == 1 or not dist.is_initialized() or dist.get_backend() == "fake":
        return None  # alone, or the dry run's recording group (nothing ever waits)
    return StallWatch(limit_for(dist.get_backend(), pctx.timeout_s), pctx.global_rank)


class PipelineEngine(CheckpointMethods, EngineSurface):
    """Trains a PipelineModule with a ZeroOptimizer; see the module docstring.

    The activations between stages have the module's declared `activation_shape(micro_batch_size)`
    (travelling in `dtype`), or, when it declares none, the shapes the stages agree on with the
    first micro-batch (`megazero.pipeline.p2p`).
    """

    def __init__(self, module: PipelineModule, pctx: ParallelContext, optimizer, lr_scheduler,
                 num_microbatches: int, schedule: str = "1f1b", chunks: int = 1, micro_batch_size: int = 1,
                 dtype=torch.float32, on_instruction=None, device="cpu", local_rank: int = 0, training_data=None,
                 monitor=None, silent_check: SilentCheck | None = None, keep_step_rng: bool = False, config=None):
        self.module, self.pctx, self.optimizer, self.lr_scheduler = module, pctx, optimizer, lr_scheduler
        self.config = config  # the resolved Config it was built from (None when built by hand)
        self.monitor = monitor  # DeepSpeed's engine.monitor (megazero.compat.monitor.MonitorMaster), or None
        self.silent_check = silent_check  # checked steps run twice (megazero.resilience.silent_check), or None
        self.keep_step_rng, self.step_rng = keep_step_rng, None  # checkpoint.save_on_failure (checkpoint/failure_save.py)
        self.p2p_ready = False  # a first step has run (its boundaries' shapes are known)
        self.num_microbatches, self.chunks = num_microbatches, chunks
        self.micro_batch_size, self.local_rank = micro_batch_size, local_rank
        # DeepSpeed's train_batch() without an iterator reads initialize(training_data=...)'s loader, endlessly
        self.training_iter = iter(RepeatingLoader(training_data)) if training_data is not None else None
        programs = get_schedule(schedule, pctx.pp_size, num_microbatches, chunks)
        self.program = programs[pctx.pp_rank]
        self.eval_program = forward_only(pctx.pp_size, num_microbatches, pctx.pp_rank, chunks)
        if getattr(module, "batch_everywhere", False):  # every stage reads the micro-batches (packed documents)
            self.program = with_loads_everywhere(self.program)
            self.eval_program = with_loads_everywhere(self.eval_program)
        self.device = torch.device(device)
        shape = module.activation_shape(micro_batch_size) if module.activation_shape is not None else None
        self.p2p = PipeP2P(pctx.pp_group, shape, dtype, self.device) if pctx.pp_size > 1 else None
        # zero bubble: the store megazero's linears were built with, or (a user's PipelineModule) a new
        # one that the module's plain nn.Linear layers are routed through
        store = module.wgrad_store
        if splits_backward(programs):
            store = store or WeightGradStore()
            defer_linears(module, store)  # plain nn.Linear layers (megazero's own take the store at build)
        self.executor = PipelineExecutor(module, self.p2p, optimizer, pctx.pp_rank, pctx.pp_size,
                                         rank=pctx.global_rank, on_instruction=on_instruction,
                                         wgrad_store=store, device=self.device, watch=_stall_watch(pctx))
        if module.activation_checkpointer is not None:  # its contiguous buffer holds the forwards in flight
            module.activation_checkpointer.set_in_flight(peaks(self.program)[0])
        self.global_steps = 0
        self.applied_steps = 0  # the optimizer's step_count + skipped_steps when the step being run began
        self.pending_save = None  # the asynchronous checkpoint save in flight (engine/checkpointing.py)
        self.last_info: dict = {}

    def needs_data(self) -> bool:
        """Whether this stage loads micro-batches (first and last virtual stage only)."""
        return any(isinstance(i, I.LoadMicroBatch) for i in self.program)

    def train_batch(self, data_iter=None) -> float:
        """One optimizer step over `num_microbatches` micro-batches (dicts or DeepSpeed's (inputs, labels)
        pairs, from `data_iter` or else the training data's loader); the mean loss on every rank, read
        on the host (one synchronisation: `train_step` has none)."""
        return float(self.train_step(data_iter))

    def train_step(self, data_iter=None) -> torch.Tensor:
        """`train_batch` with the mean loss left on the device (0-d fp64; the trainer reads it when it
        logs)."""
        data_iter = self._data(data_iter)
        self.applied_steps = self.optimizer.step_count + self.optimizer.skipped_steps  # (failure_save)
        self.module.train()
        # MoE aux losses are scaled as the LM loss is: loss scale / micro-batches (every MoE layer, a user's too)
        set_aux_loss_scale(self.module, self.optimizer.scaler.scale / self.num_microbatches)
        check = self.silent_check
        if self.keep_step_rng:  # the random states at the step's start, what a failure save writes
            self.step_rng = rng_states(self.module)
        # not a process's first step: a boundary's shapes travel then, in the first pass only
        if check is not None and self.p2p_ready and (check.due(self.global_steps + 1) or check.spike):
            st = self._checked_step(data_iter, check)
        else:
            st = self.executor.run(self.program, data_iter, self.num_microbatches)
        self.last_info = dict(st.info)
        spec = getattr(self.module, "model_spec", None)
        if spec is not None and spec.moe is not None:  # load balance, agreed over the world (read when logged)
            self.last_info["moe"] = step_stats(self.module, self.pctx.world_group, self.pctx.tp_size, spec.layers,
                                               spec.moe.num_experts, self.device)
        if self.lr_scheduler is not None and not st.info.get("skipped", False):
            step_lr_scheduler(self.lr_scheduler)
        self.global_steps += 1
        loss = self._agree_loss(st.losses)
        self._monitor_step(loss, self.global_samples)  # only with a monitor on (it reads the loss)
        self.p2p_ready = True
        return loss

    def _checked_step(self, data_iter, check: SilentCheck):
        """A step checked for silent errors (`megazero.resilience.silent_check`): the program's forwards and
        backwards run twice on the same micro-batches and random states with no reduction launched, each rank's
        communication and gradients fingerprinted; every rank's verdict is gathered over the world group; then
        the program's reduction and update run once (or, on a mismatch, every rank stops, skips or warns alike).
        With the spike check on, every step comes here: the first pass's loss, agreed as the largest over the world
        group with whether it spiked (one all-reduce of two numbers), decides on every rank alike whether the second
        pass runs."""
        opt, stats, step = self.optimizer, self.pctx.stats, self.global_steps + 1
        loads = sum(isinstance(i, I.LoadMicroBatch) for i in self.program)
        batches = [next(data_iter) for _ in range(loads)]  # the step's micro-batches, replayed by each pass
        passes = [i for i in self.program if not isinstance(i, (I.ReduceGrads, I.OptimizerStep))]
        update = [i for i in self.program if isinstance(i, (I.ReduceGrads, I.OptimizerStep))]
        grads = [g.grad_flat for g in opt.groups if g.full_grads]  # ZeRO 0-1: this rank's own gradients
        rng = rng_states(self.module)
        overlap, opt.overlap = opt.overlap, False  # no reduction during the passes: the gradients stay local
        try:
            stats.fingerprints = []
            st = self.executor.run(passes, iter(batches), self.num_microbatches)
            first = check.fingerprints(stats, grads)
            grads_a = [g.clone() for g in grads] if check.rtol else None  # bitwise: the fingerprints suffice
            if check.due(step) or (check.spike and self._spiked(check, st.losses)):
                opt.zero_grad()
                set_rng_states(self.module, rng)
                stats.fingerprints = []
                st = self.executor.run(passes, iter(batches), self.num_microbatches)
                found = check.verdict(step, first, check.fingerprints(stats, grads), grads_a, grads)
                if found["ranks"]:
                    st.info = self._silent_error(check, found)
                    if st.info.get("skipped"):
                        return st
            stats.fingerprints = None
            done = self.executor.run(update, iter(()), self.num_microbatches)
        finally:
            opt.overlap, stats.fingerprints = overlap, None
        done.losses, done.info = st.losses, {**done.info, **st.info}
        return done

    def _spiked(self, check: SilentCheck, losses) -> bool:
        """Whether this step's loss spiked (`SilentCheck.spiked`), agreed over the world group: the largest loss
        and any rank's verdict in one all-reduce (max), so that every rank runs the second pass or none does,
        whatever a silent error did to one rank's loss."""
        loss = self._agree_loss(losses)
        both = torch.stack([loss.float(), torch.tensor(float(check.spiked(float(loss))), device=loss.device)])
        comm.all_reduce(both, self.pctx.world_group, op="max")
        worst, spiked = both.tolist()
        check.record_loss(worst)
        return bool(spiked)

    def _silent_error(self, check: SilentCheck, found: dict) -> dict:
        """What a checked step that found an error does, on every rank alike (`resilience.silent_error_action`):
        stop (raise), skip (drop the gradients; the step is not applied and counted as skipped) or warn."""
        if check.action == "stop":
            raise SilentError(check.message(found))
        if self.pctx.global_rank == 0:
            print(check.message(found), flush=True)
        if check.action == "skip":
            return {**self.optimizer.skip_step(), "silent_error": found}
        return {"silent_error": found}

    def gradient_accumulation_steps(self) -> int:
        return self.num_microbatches

    def is_first_stage(self) -> bool:
        return self.pctx.is_first_stage

    def is_last_stage(self) -> bool:
        return self.pctx.is_last_stage

    def _data(self, data_iter):
        if data_iter is None and self.training_iter is None and self.needs_data():
            raise ValueError("train_batch(data_iter=None): pass an iterator of micro-batches, or give "
                             "megazero.initialize(training_data=...) a dataset")
        return data_iter if data_iter is not None else self.training_iter

    @torch.no_grad()
    def eval_batch(self, data_iter=None) -> float:
        """Forward only over `num_microbatches` micro-batches; the mean loss on every rank."""
        data_iter = self._data(data_iter)
        self.module.eval()
        st = self.executor.run(self.eval_program, data_iter, self.num_microbatches)
        return float(self._agree_loss(st.losses))

    def _agree_loss(self, losses) -> torch.Tensor:
        """Mean over micro-batches (last stage), over dp and cp (all-reduce over the dp_cp group: each cp rank's
        loss is its share of the sequence's), to every stage (broadcast over the pp group): a 0-d fp64 device
        tensor, no host synchronisation."""
        t = torch.zeros(1, dtype=torch.float64, device=self.device)
        if losses:
            t += torch.stack([l.double() for l in losses]).mean()
        comm.all_reduce(t, self.pctx.dp_cp_group)
        t /= self.pctx.dp_cp_group.size
        comm.broadcast(t, self.pctx.pp_size - 1, self.pctx.pp_group)
        return t[0]
