"""Recompute regions: run code whose saved-for-backward tensors are dropped, then rebuilt in backward.

A `Frame` is one region run (one checkpointed layer or segment, or one attention core, for one
micro-batch). Inside ``with frame.hooks():`` every tensor autograd saves for backward is replaced by an
integer placeholder (`torch.autograd.graph.saved_tensors_hooks`). The first time backward unpacks a
placeholder, the frame recomputes the region once: it restores the region's inputs from its `store`
(see storage.py; an all-gather over the TP group for partitioned checkpoints, a host-to-device copy for
CPU checkpoints), replays the random state, re-runs `replay(*inputs)` with grad enabled, and keeps what
that run saves, in order. The original graph then uses the recomputed tensors, so gradients flow
through the graph built in the forward: `torch.autograd.grad(..., inputs=params)` (the zero-bubble
executor's B pass) and ZeRO's gradient hooks behave as without checkpointing.

`Anchor` is the region's entry: an identity on the region inputs that saves the kept checkpoint
tensors with `save_for_backward`, so saved-tensor measurement (megazero.run.memory) sees exactly what a
checkpoint keeps, and whose backward frees the kept input (and its contiguous-buffer slot) once the
gradient has reached the region's input.

Discrete choices (`Decisions`): a layer whose forward makes a data-dependent choice that shapes the
computation or its communication (MoE routing: which experts, the all-to-all split sizes) records it
with ``decisions.remember(key, make)`` while the frame runs forward, and its recompute gets the same
value back instead of deciding again: recomputed numerics that are not bit-identical cannot change it.

Random state (`RNGSnapshot`): the region's RNG-tracker streams (CPU and CUDA generators, the TP
stream included), the global CPU generator and, for CUDA inputs, the device's global generator are
captured at region entry; the recompute runs with them restored and puts the current states back
afterwards, so dropout masks replay exactly and the forward streams of later micro-batches are
untouched. Dropouts with an injected `LogicalMaskFn` have their per-site call counters replayed too.
"""
from __future__ import annotations

import contextlib
import time

import torch
from torch.autograd.graph import saved_tensors_hooks

from megazero.tensor_parallel import Dropout, LogicalMaskFn


class RNGSnapshot:
    """Generator states at a region's entry (see the module docstring); `replay()` restores them
    for the duration of a block and then restores whatever was current before."""

    def __init__(self, trackers, device: torch.device, mask_fns=()):
        self.trackers = list(trackers)
        self.tracker_states = [t.get_states() for t in self.trackers]
        self.cpu_state = torch.get_rng_state()
        self.cuda_device = device if device.type == "cuda" else None
        self.cuda_state = torch.cuda.get_rng_state(device) if self.cuda_device is not None else None
        self.mask_fns = list(mask_fns)
        self.mask_calls = [dict(f.calls) for f in self.mask_fns]

    def nbytes(self) -> int:
        """Host bytes this snapshot holds (generator states)."""
        n = self.cpu_state.numel() + (self.cuda_state.numel() if self.cuda_state is not None else 0)
        return n + sum(s.numel() for states in self.tracker_states for s in states.values())

    @contextlib.contextmanager
    def replay(self):
        current = RNGSnapshot(self.trackers, self.cuda_device or torch.device("cpu"), self.mask_fns)
        self._apply()
        try:
            yield
        finally:
            current._apply()

    def _apply(self) -> None:
        for tracker, states in zip(self.trackers, self.tracker_states):
            tracker.set_states(states)
        torch.set_rng_state(self.cpu_state)
        if self.cuda_device is not None:
            torch.cuda.set_rng_state(self.cuda_state, self.cuda_device)
        for fn, calls in zip(self.mask_fns, self.mask_calls):
            fn.calls = dict(calls)


def dropout_state_of(modules):
    """(RNG trackers, LogicalMaskFn mask functions) used by the Dropout modules under `modules`,
    each once. Another kind of injected mask function cannot be replayed: an error names its site."""
    trackers, mask_fns = {}, {}
    for mod in modules:
        for m in mod.modules():
            if not isinstance(m, Dropout):
                continue
            trackers[id(m.tracker)] = m.tracker
            if m.mask_fn is None:
                continue
            if not isinstance(m.mask_fn, LogicalMaskFn):
                raise ValueError(f"{m.site}: activation checkpointing replays dropout through the RNG tracker or "
                                 f"a LogicalMaskFn; an injected mask function of type "
                                 f"{type(m.mask_fn).__name__} would give different masks in the recompute")
            mask_fns[id(m.mask_fn)] = m.mask_fn
    return list(trackers.values()), list(mask_fns.values())


class Decisions:
    """The discrete choices made inside recompute regions, kept per `Frame` (see the module docstring).
    One per checkpointer; layers receive it at construction. Outside any region `remember` just
    makes the value."""

    def __init__(self):
        self._frame: "Frame | None" = None
        self._replaying = False
        self._replayed: dict[str, int] = {}  # key -> values handed back in the running recompute

    @property
    def replaying(self) -> bool:
        """Inside a recompute (values come from the frame's record)."""
        return self._replaying

    @contextlib.contextmanager
    def active(self, frame: "Frame", replaying: bool):
        """Within the block, `remember` records into `frame` (forward) or replays from it (recompute)."""
        before = (self._frame, self._replaying, self._replayed)
        self._frame, self._replaying, self._replayed = frame, replaying, {}
        try:
            yield
        finally:
            self._frame, self._replaying, self._replayed = before

    def remember(self, key: str, make):
        """``make()`` in a region's forward (recorded under `key`, in call order) or outside regions; in
        its recompute (each, if there are several), the value the forward made for the same call."""
        frame = self._frame
        if frame is None:
            return make()
        if not self._replaying:
            value = make()
            frame.made.setdefault(key, []).append(value)
            return value
        made, i = frame.made.get(key, []), self._replayed.get(key, 0)
        if i >= len(made):
            raise RuntimeError(f"checkpoint {frame.name}: the recompute asked for decision {key!r} #{i}, which its "
                               f"forward did not make (the region must run the same operations)")
        self._replayed[key] = i + 1
        return made[i]


class Frame:
    """One run of a recompute region (see the module docstring).

    Args:
        replay: ``replay(*inputs)`` re-runs the region on restored inputs (its result is ignored).
        store: the `CheckpointStore` that keeps the region inputs.
        stored: what `store.save` returned for this run's inputs.
        rng: the region's `RNGSnapshot`.
        name: for error messages ("layers.3-4", "layers.3.attn core").
        stats: a `CheckpointStats` to count recomputes and time them.
        synchronize: synchronize the device at the start of the recompute.
        observers: objects with ``hold(tensor) -> holder`` (memory meters); each recomputed tensor's
            holders live until backward unpacks it.
        log: the `Decisions` this frame's forward records into and its recompute replays from.
    """

    def __init__(self, replay, store, stored, rng: RNGSnapshot, name: str, stats, synchronize: bool = False,
                 observers=(), log: Decisions | None = None):
        self.replay, self.store, self.stored, self.rng, self.name = replay, store, stored, rng, name
        self.stats, self.synchronize, self.observers = stats, synchronize, observers
        self.log = log if log is not None else Decisions()
        self.made: dict[str, list] = {}  # key -> what the forward decided, in call order (`Decisions`)
        self.count = 0
        self.recomputed: dict[int, tuple] = {}  # handle -> (tensor, observers' holders)

    @contextlib.contextmanager
    def hooks(self):
        """Within the block, tensors saved for backward become placeholders of this frame, and
        decisions are recorded into it."""
        with saved_tensors_hooks(self._pack, self._unpack), self.log.active(self, replaying=False):
            yield

    def _pack(self, tensor: torch.Tensor) -> int:
        self.count += 1
        return self.count - 1

    def _unpack(self, handle: int) -> torch.Tensor:
        if handle not in self.recomputed:
            self._recompute()
        return self.recomputed.pop(handle)[0]

    def _recompute(self) -> None:
        if self.stored is None:
            raise RuntimeError(f"checkpoint {self.name}: a saved tensor was needed after the region's input "
                               f"gradient was computed and its checkpoint freed")
        device = self.stored.device
        if self.synchronize:
            self.stats.synchronize(device)
        start = self.stats.now(device)
        inputs = self.store.load(self.stored)
        sink: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> int:
            # Leaves (parameters, the restored inputs) and views of leaves that require grad (a transposed
            # weight) stay as saved, as autograd would keep them: their graph is view nodes down to an
            # AccumulateGrad, nothing the recompute saved. Everything else is detached so the recompute graph
            # is not kept alive. The base must require grad: an output of a custom autograd Function can be a
            # view of a plain tensor made inside its forward (F.linear's 3-D result is a view of its 2-D GEMM
            # output), which has no grad_fn either, yet the view's grad_fn is the Function's node.
            base = t._base
            own = t.grad_fn is None or (base is not None and base.grad_fn is None and base.requires_grad)
            sink.append(t if own else t.detach())
            return len(sink) - 1

        with (self.rng.replay(), torch.enable_grad(), saved_tensors_hooks(keep, _never_unpacked),
              self.log.active(self, replaying=True)):
            self.replay(*inputs)
        # The recompute graph's saved variables hold `keep` (autograd keeps a saved variable's hooks), so a
        # graph still reachable from a kept tensor would close a cycle through C++ autograd nodes, which
        # Python's gc cannot collect: hand the tensors over and leave the closure's list empty.
        kept, sink[:] = list(sink), []
        if len(kept) != self.count:
            raise RuntimeError(f"checkpoint {self.name}: the recompute saved {len(kept)} tensors for backward, "
                               f"the forward saved {self.count}; the region must run the same operations "
                               f"(no data-dependent control flow)")
        self.recomputed = {i: (t, [o.hold(t) for o in self.observers]) for i, t in enumerate(kept)}
        self.made = {}  # replayed once: the decisions are done with
        self.stats.recomputed(self.stats.now(device) - start)

    def release_input(self) -> None:
        """Free the kept input (the region's input gradient is done)."""
        if self.stored is not None:
            self.store.free(self.stored)
            self.stored = None


def _never_unpacked(handle):
    raise RuntimeError("a tensor saved while recomputing a checkpoint was unpacked; the recompute graph is "
                       "never differentiated")


class Anchor(torch.autograd.Function):
    """Region entry: forward returns views of `inputs` and saves the checkpoint's kept tensors (so
    saved-tensor hooks count them); backward passes the gradients through and frees the kept input."""

    @staticmethod
    def forward(ctx, frame: Frame, num_inputs: int, *tensors):
        inputs, kept = tensors[:num_inputs], tensors[num_inputs:]
        ctx.frame, ctx.num_kept = frame, len(kept)
        ctx.save_for_backward(*kept)
        out = tuple(t.view_as(t) for t in inputs)
        # an input that needs no gradient (a mask, indices) stays so: the recompute restores it without one
        ctx.mark_non_differentiable(*(o for o, t in zip(out, inputs, strict=True) if not t.requires_grad))
        return out if len(out) > 1 else out[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.frame.release_input()
        return (None, None, *grads, *([None] * ctx.num_kept))


def enter(frame: Frame, inputs, kept) -> tuple:
    """Pass `inputs` through the region's `Anchor`; returns the tensors the region must use."""
    out = Anchor.apply(frame, len(inputs), *inputs, *kept)
    return out if isinstance(out, tuple) else (out,)


class CheckpointStats:
    """Counters of one checkpointer (this rank): checkpoints taken, recomputes, bytes kept and
    all-gathered, device synchronizations, and, with `profile`, seconds spent in checkpointed forwards
    and in recomputes."""

    def __init__(self, profile: bool = False):
        self.profile = profile
        self.reset()

    def reset(self) -> None:
        self.checkpoints = self.recomputes = self.synchronizations = 0
        self.kept_bytes = self.gathered_bytes = self.rng_state_bytes = 0
        self.forward_s = self.recompute_s = 0.0

    def synchronize(self, device: torch.device) -> None:
        """A checkpoint boundary: wait for the device's queued work (CUDA; nothing is queued on CPU)."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.synchronizations += 1

    def now(self, device: torch.device) -> float:
        """A timestamp for profiling (after the device's queued work when profiling on CUDA)."""
        if not self.profile:
            return 0.0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def recomputed(self, seconds: float) -> None:
        self.recomputes += 1
        if self.profile:
            self.recompute_s += seconds

    def as_dict(self) -> dict:
        out = {"checkpoints": self.checkpoints, "recomputes": self.recomputes, "kept_bytes": self.kept_bytes,
               "gathered_bytes": self.gathered_bytes, "rng_state_bytes": self.rng_state_bytes,
               "synchronizations": self.synchronizations}
        if self.profile:
            out |= {"forward_s": self.forward_s, "recompute_s": self.recompute_s}
        return out
