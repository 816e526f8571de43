"""DeepSpeed's activation-checkpointing API (`deepspeed.checkpointing`), as Megatron-style models
call it: `configure(mpu, ...)`, `checkpoint(function, *args)`, `get_cuda_rng_tracker()` and
`model_parallel_cuda_manual_seed(seed)`.

`checkpoint` is torch's non-reentrant checkpoint (inputs saved, `function` recomputed in backward)
with the RNG handled as DeepSpeed's: the device's global generator (torch restores it) and the
tracker's named states (`get_cuda_rng_tracker().fork()`, Megatron's model-parallel dropout stream)
are put back as they were at the forward, so the recompute draws the same dropout masks.
`configure`'s options: `checkpoint_in_cpu` keeps the saved inputs in host memory (pinned on a GPU);
`synchronize` waits for the device before and after each checkpoint; `profile` logs each one's
forward time; `partition_activations` and `contiguous_checkpointing` split the saved inputs over
the tensor-parallel ranks, which megazero does for its own models (config
``activation_checkpointing``) but not here: with more than one tensor-parallel rank in `mpu` they
are refused; with one there is nothing to split and they have no effect (as in DeepSpeed).

DeepSpeed keeps this state in module globals; here it is one `CheckpointingState` per process
(`state()`), the same for every caller, as scripts expect.
"""
from __future__ import annotations

import contextlib
import functools
import time

import torch
import torch.utils.checkpoint

from megazero.compat.accelerator import get_accelerator
from megazero.compat.helpers import logger

MODEL_PARALLEL_RNG = "model-parallel-rng"  # Megatron's and DeepSpeed's stream name


class CudaRNGStatesTracker:
    """Named RNG states of the accelerator's global generator (DeepSpeed's class): `add(name,
    seed)` makes one, `fork(name)` runs a block drawing from it and keeps where it got to."""

    def __init__(self):
        self.states_: dict = {}
        self.seeds_: set = set()

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict:
        return dict(self.states_)

    def set_states(self, states: dict) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"rng tracker: seed {seed} is already used by another stream")
        if name in self.states_:
            raise ValueError(f"rng tracker: stream {name!r} exists already")
        acc = get_accelerator()
        before = acc.get_rng_state()
        acc.manual_seed(seed)
        self.seeds_.add(seed)
        self.states_[name] = acc.get_rng_state()
        acc.set_rng_state(before)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states_:
            raise ValueError(f"rng tracker: stream {name!r} was not added (model_parallel_cuda_manual_seed adds "
                             f"{MODEL_PARALLEL_RNG!r})")
        acc = get_accelerator()
        before = acc.get_rng_state()
        acc.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = acc.get_rng_state()
            acc.set_rng_state(before)


class CheckpointingState:
    """What `configure` set, the tracker, and the tensor-parallel rank and size of its `mpu`."""

    def __init__(self):
        self.tracker = CudaRNGStatesTracker()
        self.reset()

    def reset(self) -> None:
        self.configured = False
        self.mpu = None
        self.tp_rank, self.tp_size = 0, 1
        self.partition_activations = self.contiguous_checkpointing = False
        self.checkpoint_in_cpu = self.synchronize = self.profile = False
        self.num_checkpoints = None


@functools.cache
def state() -> CheckpointingState:
    """The process's checkpointing state (DeepSpeed's module globals, in one object)."""
    return CheckpointingState()


def _tp_of(mpu) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel group of a Megatron-style `mpu` (or DeepSpeed's grid)."""
    if hasattr(mpu, "get_tensor_model_parallel_rank"):
        return mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    return mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()


def _section(deepspeed_config) -> dict:
    """The activation_checkpointing section of a DeepSpeed config: a dict, a JSON path, or an object
    with `.activation_checkpointing_config` (DeepSpeed's DeepSpeedConfig)."""
    if deepspeed_config is None:
        return {}
    if isinstance(deepspeed_config, str):
        import json

        with open(deepspeed_config) as f:
            deepspeed_config = json.load(f)
    if isinstance(deepspeed_config, dict):
        return dict(deepspeed_config.get("activation_checkpointing", {}))
    return dict(vars(deepspeed_config.activation_checkpointing_config))


_KEYS = {"partition_activations": "partition_activations", "contiguous_memory_optimization": "contiguous_checkpointing",
         "number_checkpoints": "num_checkpoints", "cpu_checkpointing": "checkpoint_in_cpu",
         "synchronize_checkpoint_boundary": "synchronize", "profile": "profile"}


def configure(mpu_, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """DeepSpeed's `deepspeed.checkpointing.configure`: options from `deepspeed_config`'s
    activation_checkpointing section, then the keywords (which win). `mpu_` (Megatron's mpu or the
    engine's `grid`; None keeps the previous one) gives the tensor-parallel rank and size."""
    s = state()
    mpu = mpu_ if mpu_ is not None else s.mpu
    s.reset()
    s.mpu = mpu
    if mpu is not None:
        s.tp_rank, s.tp_size = _tp_of(mpu)
    for key, value in _section(deepspeed_config).items():
        if key not in _KEYS:
            raise ValueError(f"activation_checkpointing.{key}: unknown; valid: {', '.join(_KEYS)}")
        setattr(s, _KEYS[key], value)
    for attr, value in dict(partition_activations=partition_activations,
                            contiguous_checkpointing=contiguous_checkpointing, num_checkpoints=num_checkpoints,
                            checkpoint_in_cpu=checkpoint_in_cpu, synchronize=synchronize, profile=profile).items():
        if value is not None:
            setattr(s, attr, value)
    if s.contiguous_checkpointing and not s.partition_activations:
        raise ValueError("configure(contiguous_checkpointing=True) needs partition_activations=True (as DeepSpeed)")
    if s.contiguous_checkpointing and s.num_checkpoints is None:
        raise ValueError("configure(contiguous_checkpointing=True) needs num_checkpoints (as DeepSpeed)")
    if s.partition_activations and s.tp_size > 1:
        raise NotImplementedError(
            f"configure(partition_activations=True) with {s.tp_size} tensor-parallel ranks: megazero partitions "
            f"checkpointed activations for its own models (config activation_checkpointing.partition_activations "
            f"with a model spec), not for a user's checkpoint() calls; leave it off")
    s.configured = True


def is_configured() -> bool:
    return state().configured


def reset() -> None:
    """DeepSpeed's `reset` (between iterations, for contiguous buffers): nothing is held between
    checkpoints here."""


def set_num_layers(nlayers: int) -> None:
    state().num_checkpoints = nlayers


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return state().tracker


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Megatron's and DeepSpeed's seeding: the global generator gets `seed` (the same on every
    tensor-parallel rank), the tracker's model-parallel stream seed + 2718 + the tensor-parallel
    rank (from `configure`'s mpu; 0 without one)."""
    s = state()
    s.tracker.reset()
    get_accelerator().manual_seed(seed)
    s.tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + s.tp_rank)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    s = state()
    with s.tracker.fork():
        get_accelerator().manual_seed(seed + 2718 + s.tp_rank)


class _ReplayTracker:
    """torch checkpoint's `context_fn`: the forward runs as it is; the recompute runs with the
    tracker's states as they were at the forward, and leaves them as it found them."""

    def __init__(self, tracker: CudaRNGStatesTracker):
        self.tracker, self.saved = tracker, tracker.get_states()

    @contextlib.contextmanager
    def recompute(self):
        current = self.tracker.get_states()
        self.tracker.set_states(self.saved)
        try:
            yield
        finally:
            self.tracker.set_states(current)

    def contexts(self):
        return contextlib.nullcontext(), self.recompute()


def checkpoint(function, *args, **kwargs):
    """DeepSpeed's `deepspeed.checkpointing.checkpoint(function, *args)`: `function(*args, **kwargs)`
    with its activations recomputed in backward, the dropout masks (global generator and tracker
    streams) replayed; options from `configure`. Local: no communication."""
    s = state()
    if s.synchronize:
        get_accelerator().synchronize()
    start = time.perf_counter()
    replay = _ReplayTracker(s.tracker)
    saving = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) \
        if s.checkpoint_in_cpu and any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args) \
        else contextlib.nullcontext()
    with saving:
        out = torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=replay.contexts,
                                                **kwargs)
    if s.synchronize:
        get_accelerator().synchronize()
    if s.profile:
        logger.info(f"checkpoint forward: {(time.perf_counter() - start) * 1e3:.3f} ms")
    return out


non_reentrant_checkpoint = checkpoint

__all__ = ["configure", "is_configured", "reset", "set_num_layers", "checkpoint", "non_reentrant_checkpoint",
           "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed",
           "CudaRNGStatesTracker", "CheckpointingState", "state"]
