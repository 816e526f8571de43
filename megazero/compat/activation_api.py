"""DeepSpeed's activation-checkpointing API (`deepspeed.checkpointing`), as Megatron-style models
call it: `configure(mpu, ...)`, `checkpoint(function, *args)`, `get_cuda_rng_tracker()` and
`model_parallel_cuda_manual_seed(seed)`, as views over megazero's own parts.

`get_cuda_rng_tracker()` is DeepSpeed's `CudaRNGStatesTracker` over megazero's stream tracker
(`megazero.tensor_parallel.random.RNGStatesTracker`): `add(name, seed)` adds a stream there, `fork(name)`
swaps that stream's generator in for the device's global one (Megatron's model-parallel dropout
stream), `get_states`/`set_states` read and write its generators by stream name.
`model_parallel_cuda_manual_seed(seed)` seeds as DeepSpeed does: the device's global generator with
`seed`, a fresh tracker with stream ``model-parallel-rng`` at seed + 2718 + the tensor-parallel rank.

`checkpoint` runs `function` as one recompute region of megazero's checkpointer
(`megazero.activation_checkpoint.ActivationCheckpointer.checkpoint`): the tensor arguments kept, the
function recomputed in backward with the device's global generator and the tracker's streams put back
as they were at the forward, so the recompute draws the same dropout masks. `configure`'s options become
the checkpointer's: `checkpoint_in_cpu` keeps the kept inputs in host memory, `synchronize` waits for the
device at the checkpoint boundaries, `profile` logs each checkpoint's forward time.
`partition_activations` and `contiguous_checkpointing` split the saved inputs over the tensor-parallel
ranks, which megazero does for its own models (config ``activation_checkpointing``) but not here: with
more than one tensor-parallel rank in `mpu` they are refused; with one there is nothing to split and they
have no effect (as in DeepSpeed).

DeepSpeed keeps this state in module globals; here it is one `CheckpointingState` in the process's
registry (`megazero.compat.engines`, `state()`), the same for every caller, as scripts expect.
"""
from __future__ import annotations

import contextlib
import time

import torch

from megazero.activation_checkpoint import ActivationCheckpointer, CheckpointOptions
from megazero.compat.accelerator import get_accelerator
from megazero.compat.engines import registry
from megazero.compat.helpers import logger
from megazero.runtime.comm import single_rank_group
from megazero.tensor_parallel.random import RNGStatesTracker

MODEL_PARALLEL_RNG = "model-parallel-rng"  # Megatron's and DeepSpeed's stream name


class CudaRNGStatesTracker:
    """DeepSpeed's class, a view: its streams are those of `streams`, a megazero `RNGStatesTracker`
    (replaced by a fresh one on `reset`), drawn on the accelerator's current device."""

    def __init__(self):
        self.streams = RNGStatesTracker.of_streams({})

    @staticmethod
    def _device() -> torch.device:
        return torch.device(get_accelerator().current_device_name())

    def reset(self) -> None:
        self.streams = RNGStatesTracker.of_streams({})

    def get_states(self) -> dict:
        """{stream name: its generator's state} on the current device (copies)."""
        return {name: self.streams.generator(name, self._device()).get_state() for name in self.streams.seeds}

    def set_states(self, states: dict) -> None:
        """Put the streams named in `states` at those generator states."""
        for name, state in states.items():
            self.streams.generator(name, self._device()).set_state(state)

    def add(self, name: str, seed: int) -> None:
        if seed in self.streams.seeds.values():
            raise ValueError(f"rng tracker: seed {seed} is already used by another stream")
        self.streams.add(name, seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.streams.seeds:
            raise ValueError(f"rng tracker: stream {name!r} was not added (model_parallel_cuda_manual_seed adds "
                             f"{MODEL_PARALLEL_RNG!r})")
        with self.streams.fork(name, self._device()):
            yield


class CheckpointingState:
    """What `configure` set, the tracker, the tensor-parallel rank and size of its `mpu`, and the
    checkpointer `checkpoint` runs on (made from those options)."""

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
        self.checkpointer = self.make_checkpointer()

    def make_checkpointer(self) -> ActivationCheckpointer:
        """megazero's checkpointer with these options. With one tensor-parallel rank (more are refused),
        partitioning and the contiguous buffer have nothing to split: they stay off."""
        options = CheckpointOptions(policy="full", cpu_checkpointing=bool(self.checkpoint_in_cpu),
                                    synchronize_checkpoint_boundary=bool(self.synchronize),
                                    profile=bool(self.profile))
        return ActivationCheckpointer(options, single_rank_group("tp"))


def state() -> CheckpointingState:
    """The process's checkpointing state (DeepSpeed's module globals, in one object of the registry)."""
    reg = registry()
    if reg.checkpointing is None:
        reg.checkpointing = CheckpointingState()
    return reg.checkpointing


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
    s.checkpointer = s.make_checkpointer()
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


def checkpoint(function, *args, **kwargs):
    """DeepSpeed's `deepspeed.checkpointing.checkpoint(function, *args)`: `function(*args, **kwargs)`
    with its activations recomputed in backward by megazero's checkpointer (its tensor arguments kept;
    the dropout masks of the global generator and the tracker's streams replayed); options from
    `configure`. Local: no communication."""
    s = state()
    names = tuple(kwargs)
    given = (*args, *kwargs.values())
    at = [i for i, a in enumerate(given) if isinstance(a, torch.Tensor)]
    if not at:  # nothing to keep: no region (DeepSpeed's would keep no graph either)
        return function(*args, **kwargs)

    def run(*tensors):
        full = list(given)
        for i, t in zip(at, tensors, strict=True):
            full[i] = t
        return function(*full[:len(args)], **dict(zip(names, full[len(args):], strict=True)))

    start = time.perf_counter()
    out = s.checkpointer.checkpoint(run, *(given[i] for i in at), name="deepspeed.checkpointing.checkpoint",
                                    trackers=[s.tracker.streams])
    if s.profile:
        logger.info(f"checkpoint forward: {(time.perf_counter() - start) * 1e3:.3f} ms")
    return out


non_reentrant_checkpoint = checkpoint

__all__ = ["configure", "is_configured", "reset", "set_num_layers", "checkpoint", "non_reentrant_checkpoint",
           "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed",
           "CudaRNGStatesTracker", "CheckpointingState", "state"]
