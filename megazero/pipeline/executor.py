"""Walks one stage's program with a dispatch table: instruction type -> handler.

The executor owns only the per-step bookkeeping (micro-batches loaded, chunk inputs and outputs,
received gradients, losses). Everything else is handed in, and its two partners are typed here:
the stage's model (`Stage`; `megazero.pipeline.pipeline_module.PipelineModule` is one) and the
optimizer (`StepOptimizer`; `megazero.zero.optimizer.ZeroOptimizer` is one). Point-to-point
transfers go through `megazero.pipeline.p2p.PipeP2P` over the pp group: one instruction at a time,
blocking (gloo), or, when the PipeP2P is batched (NCCL), each run of consecutive p2p instructions
(`megazero.core.instructions.p2p_runs`) posted as one batch and waited on together before the next
instruction; the run's received activations become autograd leaves once it completes, and each of
its instructions is reported to `on_instruction` with the run's span.

What crosses a boundary is a tensor or a tuple of tensors (megazero.pipeline.p2p); the
floating-point ones get gradients back, and an input tensor that got none sends zeros.

Megatron's deallocation trick: once an output activation is sent downstream its storage is freed
(`out.data` becomes a 1-element tensor; for one computed tensor, not for tuples or inputs passed
on); the autograd graph stays, and the backward is run through the engine directly so the freed
shape is never checked.

A failure inside an instruction (a peer died, a collective timed out) is re-raised as
`PipelineError` naming this rank's position, e.g. "stage 2 (rank 5) waiting at RecvGrad mb 7 from
stage 3 (instruction 23 of 40)"; a batch that fails names all of its instructions ("waiting at
SendAct mb 3 to stage 3, RecvGrad mb 1 from stage 3 (instructions 17-18 of 40)").
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch
from torch.autograd import Variable

from megazero.core import instructions as I
from megazero.pipeline.p2p import P2PBatch, PipeP2P, carries_grad, tensors_of
from megazero.runtime.clock import DeviceClock
from megazero.tensor_parallel.weight_grad import WeightGradStore


def to_device(value, device: torch.device):
    """A micro-batch on `device`: its tensors moved (non-blocking: from pinned host memory the copy
    does not wait), inside tuples, lists and dicts; other values as they are. No communication."""
    if torch.is_tensor(value):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    return value


class Stage(Protocol):
    """This rank's model chunks, as the executor runs them."""

    def virtual_stage(self, chunk: int) -> int:
        """The virtual stage local `chunk` holds (Megatron's layout: chunk * p + stage)."""

    def is_first(self, chunk: int) -> bool:
        """Whether `chunk` is the model's first virtual stage (it reads the micro-batch's input)."""

    def is_last(self, chunk: int) -> bool:
        """Whether `chunk` is the model's last virtual stage (its output goes to `loss`)."""

    def forward_chunk(self, chunk: int, x: torch.Tensor | None, batch: dict | None) -> torch.Tensor:
        """Run `chunk` on `x` (None on the first virtual stage, which reads `batch`)."""

    def as_batch(self, item) -> dict:
        """A micro-batch from the data iterator as the dict the stages read."""

    def loss(self, out: torch.Tensor, batch: dict) -> torch.Tensor:
        """The micro-batch's loss from the last virtual stage's output and `batch`'s labels."""

    def chunk_parameters(self, chunk: int) -> Iterable[torch.nn.Parameter]:
        """`chunk`'s parameters, each once."""


class StepOptimizer(Protocol):
    """What the executor asks of the optimizer while it runs a step (collectives over dp inside)."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the loss scale, to run backward from."""

    def set_last_microbatch(self, last: bool) -> None:
        """Told before each backward: whether it is the step's last one (a ZeRO-2/3 reduction point)."""

    def after_backward(self) -> None:
        """After each backward (or W): reduce what became ready."""

    def accumulate_grad_into(self, param: torch.nn.Parameter, add_into) -> None:
        """Zero-bubble W: ``add_into(slot)`` adds param's whole micro-batch gradient straight into its
        accumulation slot (shaped like param); the parameter then counts as done for this micro-batch."""

    def reduce_grads(self) -> None:
        """ReduceGrads: finish the step's gradient reduction over dp (and tied weights)."""

    def step(self) -> dict:
        """OptimizerStep: clip, update, gather; returns info (grad_norm, lr, loss_scale, skipped)."""


class PipelineError(RuntimeError):
    """An instruction failed; the message says which stage, rank and instruction."""


@dataclass
class _StepState:
    data_iter: object
    num_microbatches: int
    batches: dict = field(default_factory=dict)   # mb -> micro-batch (dict of tensors)
    inputs: dict = field(default_factory=dict)    # (mb, chunk) -> input of the chunk (tensor or tuple)
    outputs: dict = field(default_factory=dict)   # (mb, chunk) -> output (or loss on the last vstage)
    grads_in: dict = field(default_factory=dict)  # (mb, chunk) -> grad received for the output
    grads_out: dict = field(default_factory=dict)  # (mb, chunk) -> grad of the input, to send
    weight_grads: dict = field(default_factory=dict)  # (mb, chunk) -> [(param, grad)] held for W
    losses: list = field(default_factory=list)
    last_weight_grad: int = -1                    # program index of the last weight-grad instruction
    info: dict = field(default_factory=dict)


def _run_backward(tensors, grads, inputs=(), keep_graph=False, accumulate=True):
    """autograd's engine without the shape check (outputs whose storage was freed after sending)."""
    return Variable._execution_engine.run_backward(
        tuple(tensors), tuple(grads), keep_graph, False, tuple(inputs), True, accumulate)


def _input_grads(x, grads):
    """The gradients to send upstream for input `x`: one per floating-point tensor of it (zeros for
    one that got none), a tensor when `x` is one tensor, else a tuple."""
    floats = [t for t in tensors_of(x) if carries_grad(t)]
    full = [g if g is not None else torch.zeros_like(t) for t, g in zip(floats, grads)]
    return full[0] if isinstance(x, torch.Tensor) and full else tuple(full)


def _as_leaves(x) -> None:
    """A received activation's floating-point tensors require grad (their grads go back upstream)."""
    for t in tensors_of(x):
        if carries_grad(t):
            t.requires_grad_()


def _add_grad(grad: torch.Tensor, slot: torch.Tensor) -> None:
    slot.add_(grad.reshape(slot.shape))


def _apply_all(fns, slot: torch.Tensor) -> None:
    for fn in fns:
        fn(slot)


class PipelineExecutor:
    """Runs programs for one pipeline stage (`stage_index` of `num_stages`; `rank` is this rank's
    global rank, for messages). `p2p` is None with one stage. `wgrad_store`: the store the stage's
    linear layers were built with (zero bubble), or None."""

    def __init__(self, stage: Stage, p2p: PipeP2P | None, optimizer: StepOptimizer, stage_index: int,
                 num_stages: int, rank: int = 0, on_instruction=None, wgrad_store: WeightGradStore | None = None,
                 device="cpu", watch=None):
        self.stage, self.p2p, self.opt = stage, p2p, optimizer
        self.watch = watch  # a `megazero.runtime.stall_watch.StallWatch`: told each position, armed during run()
        self.device = torch.device(device)
        self.wgrad_store = wgrad_store  # zero bubble: linear layers defer their weight GEMMs to W
        self.stage_index, self.num_stages, self.rank = stage_index, num_stages, rank
        self.on_instruction = on_instruction  # callback(ins, start_s, end_s) for traces
        self.clock = DeviceClock(self.device)  # CUDA events on GPU: the host clock only sees launches
        self.handlers = {
            I.LoadMicroBatch: self._load, I.Forward: self._forward, I.Backward: self._backward,
            I.BackwardInput: self._backward_input, I.BackwardWeight: self._backward_weight,
            I.SendAct: self._send_act, I.RecvAct: self._recv_act, I.SendGrad: self._send_grad,
            I.RecvGrad: self._recv_grad, I.ReduceGrads: self._reduce, I.OptimizerStep: self._step,
        }

    @property
    def batched(self) -> bool:
        """Whether runs of consecutive p2p instructions go out as one batch (the PipeP2P's choice)."""
        return self.p2p is not None and self.p2p.batched

    def run(self, program, data_iter, num_microbatches: int) -> _StepState:
        """Execute `program`; returns the step state (losses on the last stage, optimizer info).
        Batched: starts with `PipeP2P.connect` (a barrier over the pp group on the first step)."""
        st = _StepState(data_iter, num_microbatches)
        weight_grads = [i for i, ins in enumerate(program) if isinstance(ins, (I.Backward, I.BackwardWeight))]
        st.last_weight_grad = weight_grads[-1] if weight_grads else -1
        # (start, stop) of each span run at once: a batch of p2p instructions, else one instruction
        runs = dict(I.p2p_runs(program)) if self.batched else {}
        marks = []  # (instruction, start token, end token) until the clock resolves them (CUDA events)
        if self.watch is not None:
            self.watch.arm()
        try:
            if self.batched:
                self._connect()
            pos = 0
            while pos < len(program):
                stop = runs.get(pos, pos + 1)
                t0 = self.clock.mark() if self.on_instruction is not None else None
                if pos in runs:
                    self._run_batch(program, pos, stop, st)
                else:
                    self._run_one(program, pos, program[pos], st)
                if self.on_instruction is not None:
                    t1 = self.clock.mark()
                    marks += [(ins, t0, t1) for ins in program[pos:stop]]
                    while marks and not self.clock.deferred:
                        self.on_instruction(*marks.pop(0))
                pos = stop
        finally:  # on CUDA: one synchronisation per step turns the events into times (also after a failure)
            if self.watch is not None:
                self.watch.disarm()
            if marks:
                times = self.clock.resolve([t for _, start, end in marks for t in (start, end)])
                for k, (ins, _, _) in enumerate(marks):
                    self.on_instruction(ins, times[2 * k], times[2 * k + 1])
        return st

    def _connect(self) -> None:
        try:
            self.p2p.connect()
        except Exception as exc:
            raise PipelineError(f"stage {self.stage_index} (rank {self.rank}) waiting at the pp group's barrier "
                                f"before its first batched transfer: {type(exc).__name__}: {exc}") from exc

    def _run_one(self, program, pos: int, ins, st, batch: P2PBatch | None = None) -> None:
        """Instruction `pos` of `program` (a p2p one posted to `batch` when given), its failure
        re-raised as a PipelineError naming where (and told to the stall watch first: on NCCL a wait
        that cannot complete does not raise here)."""
        if self.watch is not None:
            self.watch.note(f"stage {self.stage_index} (rank {self.rank}) at {ins.describe()} "
                            f"(instruction {pos + 1} of {len(program)})")
        try:
            if pos == st.last_weight_grad:
                self.opt.set_last_microbatch(True)
            elif pos < st.last_weight_grad and isinstance(ins, (I.Backward, I.BackwardWeight)):
                self.opt.set_last_microbatch(False)
            if batch is None:
                self.handlers[type(ins)](ins, st)
            else:
                self.handlers[type(ins)](ins, st, batch)
        except Exception as exc:
            raise PipelineError(f"stage {self.stage_index} (rank {self.rank}) waiting at {ins.describe()} "
                                f"(instruction {pos + 1} of {len(program)}): {type(exc).__name__}: {exc}") from exc

    def _run_batch(self, program, start: int, stop: int, st) -> None:
        """The p2p instructions `start:stop` of `program` as one batch over the pp group: each posts
        its tensors in program order (a boundary's metadata moves alone, in place), then all are
        waited on together; the received activations then become autograd leaves."""
        batch = self.p2p.batch()
        for pos in range(start, stop):
            self._run_one(program, pos, program[pos], st, batch)
        try:
            batch.flush()
        except Exception as exc:
            where = ", ".join(ins.describe() for ins in program[start:stop])
            span = f"instruction {start + 1}" if stop == start + 1 else f"instructions {start + 1}-{stop}"
            raise PipelineError(f"stage {self.stage_index} (rank {self.rank}) waiting at {where} "
                                f"({span} of {len(program)}): {type(exc).__name__}: {exc}") from exc
        for ins in program[start:stop]:
            if isinstance(ins, I.RecvAct):
                _as_leaves(st.inputs[(ins.mb, ins.chunk)])

    # -- handlers ------------------------------------------------------------------------------
    def _load(self, ins, st):
        batch = self.stage.as_batch(next(st.data_iter))
        st.batches[ins.mb] = to_device(batch, self.device)

    def _forward(self, ins, st):
        key = (ins.mb, ins.chunk)
        batch = st.batches.get(ins.mb)
        x = st.inputs.get(key)
        out = self.stage.forward_chunk(ins.chunk, x, batch)
        if self.stage.is_last(ins.chunk):
            loss = self.stage.loss(out, batch)
            st.losses.append(loss.detach())
            out = self.opt.scale_loss(loss / st.num_microbatches)
        st.outputs[key] = out

    def _grad_pair(self, key, st):
        """The chunk's outputs that backward starts from and their gradients: the (scaled) loss and
        one on the last virtual stage, else the floating-point activations sent downstream (those
        that require grad) and the gradients received for them."""
        out = st.outputs[key]
        if key not in st.grads_in:
            return [out], [torch.ones_like(out)]
        floats = [t for t in tensors_of(out) if carries_grad(t)]
        grads = tensors_of(st.grads_in.pop(key))
        pairs = [(t, g) for t, g in zip(floats, grads) if t.requires_grad]
        return [t for t, _ in pairs], [g for _, g in pairs]

    def _backward(self, ins, st):
        key = (ins.mb, ins.chunk)
        outs, grads = self._grad_pair(key, st)
        if outs:
            _run_backward(outs, grads)
        self._after_input_grad(key, st)
        st.outputs.pop(key)
        self.opt.after_backward()

    def _backward_input(self, ins, st):
        """Zero-bubble B: the input grad (sent upstream at once). Linear layers holding the
        `wgrad_store` defer their weight-grad GEMMs to W; the other (small) parameter grads are
        computed here and held back, unaccumulated, until W."""
        key = (ins.mb, ins.chunk)
        x = st.inputs.pop(key, None)
        outs, out_grads = self._grad_pair(key, st)
        st.outputs.pop(key)
        params = [p for p in self.stage.chunk_parameters(ins.chunk) if p.requires_grad]
        xs = [t for t in tensors_of(x) if carries_grad(t)] if x is not None else []
        inputs = xs + params

        def input_and_param_grads():
            if outs and inputs:
                return _run_backward(outs, out_grads, inputs=inputs, accumulate=False)
            return (None,) * len(inputs)  # nothing to differentiate (or nothing reaches this chunk)
        if self.wgrad_store is not None:
            with self.wgrad_store.defer():
                grads = input_and_param_grads()
            deferred = self.wgrad_store.take()
        else:
            grads, deferred = input_and_param_grads(), []
        if x is not None:
            st.grads_out[key] = _input_grads(x, grads[:len(xs)])
        st.weight_grads[key] = (list(zip(params, grads[len(xs):])), deferred)

    def _backward_weight(self, ins, st):
        """Zero-bubble W: every gradient held since B to the optimizer, then the deferred weight-grad
        GEMMs, each accumulated straight into the parameter's gradient slot."""
        ready, deferred = st.weight_grads.pop((ins.mb, ins.chunk))
        adds: dict[int, tuple[torch.nn.Parameter, list]] = {}  # a weight used twice gets both parts at once
        for param, grad in ready:
            if grad is not None:
                adds.setdefault(id(param), (param, []))[1].append(functools.partial(_add_grad, grad))
        for entry in deferred:
            adds.setdefault(id(entry[0]), (entry[0], []))[1].append(functools.partial(WeightGradStore.add_into, entry))
        for param, fns in adds.values():
            self.opt.accumulate_grad_into(param, functools.partial(_apply_all, fns))
        self.opt.after_backward()

    def _after_input_grad(self, key, st):
        x = st.inputs.pop(key, None)
        if x is not None:
            st.grads_out[key] = _input_grads(x, [t.grad for t in tensors_of(x) if carries_grad(t)])

    # Boundary v is between virtual stages v and v + 1: a chunk's output crosses its own boundary,
    # its input (and the input's gradient) the one before.
    def _send_act(self, ins, st, batch=None):
        key = (ins.mb, ins.chunk)
        out = st.outputs[key]
        # with a batch, freeing below is safe before it completes: the batch holds the sent tensor's storage
        self.p2p.send_activation(out, ins.peer, self.stage.virtual_stage(ins.chunk), batch)
        if not torch.is_grad_enabled():  # a forward-only program: nothing reads the output again
            del st.outputs[key]
        elif isinstance(out, torch.Tensor) and out.grad_fn is not None:
            # Only autograd's own node saved this output (as an output, a copy of the tensor's handle):
            # free the data, the graph stays. A tuple's tensors are kept: one of them may be saved as an
            # input by the node that made another, and freeing it would corrupt that backward.
            out.data = torch.empty((1,), dtype=out.dtype, device=out.device)

    def _recv_act(self, ins, st, batch=None):
        x = self.p2p.recv_activation(ins.peer, self.stage.virtual_stage(ins.chunk) - 1, batch)
        if batch is None:  # batched: once the batch completes (_run_batch)
            _as_leaves(x)
        st.inputs[(ins.mb, ins.chunk)] = x

    def _send_grad(self, ins, st, batch=None):
        grad = st.grads_out.pop((ins.mb, ins.chunk))
        self.p2p.send_grad(grad, ins.peer, self.stage.virtual_stage(ins.chunk) - 1, batch)

    def _recv_grad(self, ins, st, batch=None):
        st.grads_in[(ins.mb, ins.chunk)] = self.p2p.recv_grad(ins.peer, self.stage.virtual_stage(ins.chunk), batch)

    def _reduce(self, ins, st):
        self.opt.reduce_grads()

    def _step(self, ins, st):
        st.info = self.opt.step()
