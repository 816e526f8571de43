"""Activation checkpointing policies for transformer blocks, chosen by ``activation_checkpointing``.

* ``none``: every block keeps what autograd saves.
* ``full``: blocks are grouped into segments of consecutive blocks of one model chunk; a segment keeps
  only its input (in the `CheckpointStore` form: plain, partitioned across TP, on the host, in a
  contiguous buffer) and is recomputed as a whole in backward. ``every_k_layers`` = k blocks per
  segment (k = 1: each layer's input kept, the table's "full recompute"); ``number_checkpoints`` = n
  splits each chunk's blocks into n segments as evenly as possible instead (a chunk with fewer than n
  blocks gets one segment per block).
* ``selective`` (Korthikanti et al. 2022): only the attention core (score matmul, causal softmax,
  attention dropout, context matmul) is recomputed; it keeps q, k and v.

Use: ``ckpt = ActivationCheckpointer(options, tp_group)``; pass it to `build_pipeline_model`
(``activation_checkpointer=ckpt``: it wraps the blocks with ``ckpt.wrap_block``, gives the attention
layers ``ckpt.attention_core`` and the PipelineModule calls ``ckpt.attach(local_chunks)``); the engine
calls ``ckpt.set_in_flight(peaks(program)[0])`` (`megazero.core.simulate.peaks`) so a contiguous buffer holds
(segments per chunk) × (micro-batches in flight on this stage) checkpoints. ``ckpt.checkpoint(fn, *xs)``
checkpoints any other function. Layers whose forward makes discrete choices (MoE routing) receive
``ckpt.decisions`` at construction (`build_pipeline_model` passes it): a recompute replays the choices its
forward made (`region.Decisions`). Communication: with ``partition_activations``, one all-gather of each
kept input over `tp_group` per recompute; recomputing a block re-runs its forward TP collectives.

ZeRO-3: a wrapped block is the gathering unit. The recompute of a one-block segment runs while that
block's parameters are gathered for its backward; in a longer segment the earlier blocks are recomputed
through their module call, so their gather hooks run again (including their forward prefetch).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from megazero.activation_checkpoint.region import (CheckpointStats, Decisions, Frame, RNGSnapshot, dropout_state_of,
                                                  enter)
from megazero.activation_checkpoint.storage import CheckpointStore, ContiguousPool
from megazero.runtime.comm import GroupHandle
from megazero.core.config.schema import CHECKPOINT_POLICY_CHOICES
from megazero.core.partition import segment_sizes

POLICIES = CHECKPOINT_POLICY_CHOICES  # one list: the config schema's


@dataclass(frozen=True)
class CheckpointOptions:
    """The ``activation_checkpointing`` config section, as the checkpointer reads it."""

    policy: str = "none"
    every_k_layers: int = 1
    number_checkpoints: int | None = None
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    @classmethod
    def from_config(cls, section) -> "CheckpointOptions":
        """From `megazero.core.config.ActivationCheckpointingConfig` (or any object with these fields)."""
        return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(cls)})

    def validate(self) -> None:
        key = "activation_checkpointing"
        if self.policy not in POLICIES:
            raise ValueError(f"{key}.policy={self.policy!r}; valid: {', '.join(POLICIES)}")
        if self.every_k_layers < 1 or (self.number_checkpoints is not None and self.number_checkpoints < 1):
            raise ValueError(f"{key}.every_k_layers and number_checkpoints must be >= 1")
        extras = [k for k in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
                  if getattr(self, k)]
        if extras and self.policy != "full":
            raise ValueError(f"{key}.{extras[0]} acts on checkpointed layer inputs; it needs {key}.policy=full")
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise ValueError(f"{key}.contiguous_memory_optimization needs {key}.number_checkpoints")


class CheckpointedBlock(nn.Module):
    """A transformer block run under the full policy by its `ActivationCheckpointer`. Parameters and
    buffers are the block's (``self.block``)."""

    def __init__(self, block: nn.Module, checkpointer: "ActivationCheckpointer"):
        super().__init__()
        self.block = block
        self.index = getattr(block, "index", None)  # duck-typed: megazero's TransformerBlock has one, a user's block may not
        self.checkpointer = checkpointer  # a plain object, not a submodule
        self.segment: _Segment = _Segment([self], checkpointer)
        self.position = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.checkpointer.run_block(self, x)

    def extra_repr(self) -> str:
        return f"segment={self.segment.name}"


class _Segment:
    """Consecutive checkpointed blocks of one chunk; one kept input, one recompute."""

    def __init__(self, wrappers: list, checkpointer: "ActivationCheckpointer"):
        self.wrappers, self.checkpointer = wrappers, checkpointer
        self.frame: Frame | None = None
        for pos, w in enumerate(wrappers):
            w.segment, w.position = self, pos

    @property
    def name(self) -> str:
        first, last = self.wrappers[0].index, self.wrappers[-1].index
        return f"layers.{first}" if first == last else f"layers.{first}-{last}"

    def replay(self, x: torch.Tensor) -> None:
        cp = self.checkpointer
        cp.replaying = True
        try:
            for w in self.wrappers[:-1]:
                x = w(x)  # the module call: ZeRO-3 gathers this block's parameters again
            self.wrappers[-1].block(x)
        finally:
            cp.replaying = False


class _SelectiveCore:
    """An attention's ``core_checkpoint`` (from `ActivationCheckpointer.attention_core`, given to its constructor): runs the attention core ``core(q, k, v)`` as a recompute region
    that keeps q, k and v (references, no copy)."""

    def __init__(self, checkpointer: "ActivationCheckpointer", name: str):
        self.checkpointer, self.name = checkpointer, name

    def __call__(self, core, q, k, v):
        cp = self.checkpointer
        if not torch.is_grad_enabled():
            return core(q, k, v)
        frame, (q, k, v) = cp.open_region(core, (q, k, v), [core.__self__], self.name, cp.reference_store)
        with frame.hooks():
            return core(q, k, v)


class ActivationCheckpointer:
    """One model's (this rank's stage's) checkpointing: see the module docstring.

    Args:
        options: the policy and DeepSpeed keys (`CheckpointOptions`).
        tp_group: the tensor-parallel group (partitioned checkpoints are split and gathered over it).
    """

    def __init__(self, options: CheckpointOptions, tp_group: GroupHandle):
        options.validate()
        self.options, self.tp_group = options, tp_group
        self.stats = CheckpointStats(options.profile)
        self.in_flight = 1
        self.pool = (ContiguousPool(1, options.cpu_checkpointing) if options.contiguous_memory_optimization
                     else None)
        self.store = CheckpointStore(tp_group, options.partition_activations, options.cpu_checkpointing,
                                     self.pool, self.stats)
        self.reference_store = CheckpointStore(tp_group, stats=self.stats)
        self.wrappers: list[CheckpointedBlock] = []
        self.segments: list[_Segment] = []
        self.per_chunk: list[int] | None = None  # segments in each chunk, once attached
        self.observers: list = []  # memory meters counting recomputed tensors (megazero.run.memory)
        self.replaying = False
        self.decisions = Decisions()  # routing decisions recorded in forward, replayed by recomputes

    @classmethod
    def from_config(cls, section, tp_group: GroupHandle) -> "ActivationCheckpointer | None":
        """A checkpointer for the ``activation_checkpointing`` config section, or None for policy none."""
        options = CheckpointOptions.from_config(section)
        return None if options.policy == "none" else cls(options, tp_group)

    # -- building ---------------------------------------------------------------------------------
    def wrap_block(self, block: nn.Module) -> nn.Module:
        """The block hook of `build_pipeline_model`: full -> a `CheckpointedBlock`; otherwise the block
        (selective checkpointing reaches the attention cores through `attention_core` at construction)."""
        if self.options.policy != "full":
            return block
        w = CheckpointedBlock(block, self)
        self.wrappers.append(w)
        self.segments.append(w.segment)
        return w

    def attention_core(self, name: str):
        """The wrapper an attention layer runs its core through, ``fn(core, q, k, v)``, or None.

        Selective policy: the core (scores, softmax, dropout, probs·V) is a recompute region that keeps
        only q, k, v. Passed to `layer_builders(attention_core=...)`, so each attention gets its wrapper
        in its constructor; `name` (``layers.<i>.attn.core``) labels the region in reports."""
        return _SelectiveCore(self, name) if self.options.policy == "selective" else None

    def attach(self, chunks) -> None:
        """Group the wrapped blocks of each chunk (a list of layer modules, e.g. a PipelineModule's
        ``local_chunks``) into segments; then size the contiguous buffer."""
        if self.options.policy != "full":
            return
        self.segments, self.per_chunk = [], []
        for layers in chunks:
            before = len(self.segments)
            run: list[CheckpointedBlock] = []
            for mod in list(layers) + [None]:
                if isinstance(mod, CheckpointedBlock) and mod.checkpointer is self:
                    run.append(mod)
                    continue
                self._split(run)
                run = []
            self.per_chunk.append(len(self.segments) - before)
        self._size_pool()

    def _split(self, run: list) -> None:
        o, start = self.options, 0
        for size in segment_sizes(len(run), o.every_k_layers, o.number_checkpoints) if run else []:
            self.segments.append(_Segment(run[start:start + size], self))
            start += size

    def set_in_flight(self, micro_batches: int) -> None:
        """How many micro-batches' forwards can be alive at once on this stage (sizes the buffer)."""
        self.in_flight = max(1, int(micro_batches))
        self._size_pool()

    def _size_pool(self) -> None:
        if self.pool is None:
            return
        per_chunk = self.per_chunk if self.per_chunk is not None else [len(self.segments)]
        slots = max(per_chunk, default=1) * self.in_flight
        if self.pool.buffer is not None and slots != self.pool.slots:
            raise RuntimeError(f"activation_checkpointing.contiguous_memory_optimization: the buffer was "
                               f"allocated with {self.pool.slots} slots; size it before the first forward")
        self.pool.slots = max(1, slots)

    # -- running ----------------------------------------------------------------------------------
    def open_region(self, replay, inputs, modules, name: str, store: CheckpointStore, trackers=()):
        """Start a recompute region on `inputs`: keep them in `store`, capture the random state of the
        Dropouts under `modules` and of `trackers` (more `RNGStatesTracker`s the region draws from), and
        pass the inputs through the region's anchor. Returns (frame, the inputs the region must use)."""
        device = inputs[0].device
        if self.options.synchronize_checkpoint_boundary:
            self.stats.synchronize(device)
        used, mask_fns = dropout_state_of(modules)
        rng = RNGSnapshot(list({id(t): t for t in [*used, *trackers]}.values()), device, mask_fns)
        stored = store.save(inputs)
        frame = Frame(replay, store, stored, rng, name, self.stats, self.options.synchronize_checkpoint_boundary,
                      self.observers, self.decisions)
        self.stats.checkpoints += 1
        self.stats.rng_state_bytes += rng.nbytes()
        return frame, enter(frame, inputs, stored.kept)

    def run_block(self, wrapper: CheckpointedBlock, x: torch.Tensor) -> torch.Tensor:
        """Forward of a wrapped block: open its segment's region (first block) or continue it."""
        if self.replaying or not torch.is_grad_enabled():
            return wrapper.block(x)
        seg = wrapper.segment
        start = self.stats.now(x.device)
        if wrapper.position == 0:
            seg.frame, (x,) = self.open_region(seg.replay, (x,), [w.block for w in seg.wrappers], seg.name,
                                               self.store)
        elif seg.frame is None:
            raise RuntimeError(f"checkpoint segment {seg.name}: block {wrapper.index} ran without the segment's "
                               f"first block before it; the blocks of a segment must run in order")
        frame = seg.frame
        if wrapper.position == len(seg.wrappers) - 1:
            seg.frame = None
        with frame.hooks():
            out = wrapper.block(x)
        self.stats.forward_s += self.stats.now(x.device) - start
        return out

    def checkpoint(self, fn, *inputs: torch.Tensor, modules=(), name: str = "checkpoint", trackers=()):
        """Run ``fn(*inputs)`` as one recompute region kept in this checkpointer's store (partitioned,
        on the host, contiguous, as configured). `modules`: whose Dropouts' random state to replay;
        `trackers`: other `RNGStatesTracker`s whose streams `fn` draws from (replayed too).
        Partitioning assumes every TP rank passes the same inputs."""
        if not torch.is_grad_enabled():
            return fn(*inputs)
        frame, inputs = self.open_region(fn, inputs, list(modules), name, self.store, trackers)
        with frame.hooks():
            return fn(*inputs)

    def report(self) -> dict:
        """Policy, segments, contiguous buffer and the counters of `CheckpointStats`."""
        out = {"policy": self.options.policy, "segments": [s.name for s in self.segments]}
        if self.pool is not None:
            out |= {"contiguous_slots": self.pool.slots, "contiguous_bytes": self.pool.nbytes,
                    "contiguous_in_use": self.pool.in_use()}
        return out | self.stats.as_dict()
