"""DeepSpeed's accelerator abstraction (`deepspeed.accelerator.get_accelerator()`), over torch's CUDA
and CPU devices.

Scripts use it to stay device-agnostic: ``get_accelerator().device_name(local_rank)`` for where to
put a batch, ``communication_backend_name()`` for `init_process_group`, streams, events, memory
queries, RNG. `get_accelerator()` does not choose a device of its own: it takes the type of the device
`megazero/runtime/device.py:compute_device` gives this process (the engine's), for the backend of the
default group once it exists (gloo: the CPU), else "auto" (CUDA when torch sees a GPU, as DeepSpeed
picks); ``DS_ACCELERATOR=cpu|cuda`` asks for one (cpu as the gloo backend, cuda as nccl; other DeepSpeed
accelerators are refused by name). The CUDA one delegates every call to `torch.cuda`; the CPU one
answers as DeepSpeed's CPU accelerator does (device "cpu", synchronisation a no-op, no streams or
events, memory = the process's resident set, current device the local rank, device count the ranks on
this node, both from the launcher's environment: `megazero/core/launch_env.py:read_launch_env`), except
that its communication backend is gloo (DeepSpeed's is oneCCL, which megazero does not use).
"""
from __future__ import annotations

import contextlib
import functools
import os
import resource

import torch
import torch.distributed as dist

from megazero.compat.engines import registry
from megazero.core.launch_env import read_launch_env
from megazero.runtime.device import compute_device, visible_cuda_devices

SUPPORTED = ("cuda", "cpu")


class _Accelerator:
    """What both accelerators answer alike; `_name` is the torch device type."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_triton_supported(self) -> bool:
        return False  # megazero's kernels do not use triton

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self._name == "cuda" else []

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def op_builder_dir(self):
        raise NotImplementedError("op builders: megazero builds its own kernels (megazero.runtime.kernels) on "
                                  "first use; DeepSpeed's op_builder is not provided")

    create_op_builder = get_op_builder = op_builder_dir

    def supports_nvtx_domain(self) -> bool:
        return False

    def pin_empty(self, *size, dtype, device="cpu"):
        """An empty host tensor, pinned where a GPU makes pinning mean something."""
        return torch.empty(*size, dtype=dtype, device=device, pin_memory=torch.cuda.is_available())

    def pin_empty_like(self, tensor, device="cpu", dtype=None):
        return self.pin_empty(*tensor.shape, dtype=dtype or tensor.dtype, device=device)

    def unpin_memory(self, tensor):
        return tensor  # a pinned tensor is unpinned when freed; nothing to do ahead

    def build_extension(self):
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension

    BFloat16Tensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.bfloat16, device=self._name))
    ByteTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.uint8, device=self._name))
    DoubleTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.double, device=self._name))
    FloatTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.float, device=self._name))
    HalfTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.half, device=self._name))
    IntTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.int, device=self._name))
    LongTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.long, device=self._name))


class CudaAccelerator(_Accelerator):
    """`torch.cuda` under DeepSpeed's accelerator names."""

    _name = "cuda"
    _communication_backend_name = "nccl"

    def is_synchronized_device(self) -> bool:
        return False

    def use_host_timers(self) -> bool:
        return False

    def resolves_data_dependency(self) -> bool:
        return False

    def handles_memory_backpressure(self) -> bool:
        return False

    def device_name(self, device_index=None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index=None):
        return torch.cuda.device(device_index)

    def set_device(self, device_index) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index=None) -> None:
        torch.cuda.synchronize(device_index)

    # RNG
    def random(self):
        return torch.random

    def set_rng_state(self, new_state, device_index=None):
        return torch.cuda.set_rng_state(new_state) if device_index is None else \
            torch.cuda.set_rng_state(new_state, device_index)

    def get_rng_state(self, device_index=None):
        return torch.cuda.get_rng_state() if device_index is None else torch.cuda.get_rng_state(device_index)

    def manual_seed(self, seed):
        return torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed):
        return torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def default_generator(self, device_index):
        return torch.cuda.default_generators[device_index]

    # streams and events
    @property
    def Stream(self):
        return torch.cuda.Stream

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, device_index=None):
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index=None):
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self):
        return torch.cuda.Event

    # memory
    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index=None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index=None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index=None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index=None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_cached(self, device_index=None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index=None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index=None) -> dict:
        return torch.cuda.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index=None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index=None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index=None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def total_memory(self, device_index=None) -> int:
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index=None) -> int:
        return torch.cuda.mem_get_info(device_index)[0]

    # data types
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return True

    def is_fp64_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list:
        return [torch.float, torch.half] + ([torch.bfloat16] if self.is_bf16_supported() else [])

    # misc
    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def range_push(self, msg, domain=None, category=None):
        return torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain=None):
        return torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback):
        return torch.cuda._lazy_call(callback)

    def is_current_stream_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def create_graph(self):
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph, pool=None, stream=None):
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph) -> None:
        graph.replay()

    def pin_memory(self, tensor, make_copy=True, match_shape=True):
        return tensor.pin_memory()

    def is_pinned(self, tensor) -> bool:
        return tensor.is_pinned()

    def on_accelerator(self, tensor) -> bool:
        return tensor.device.type == "cuda"

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]


class CpuAccelerator(_Accelerator):
    """The host as DeepSpeed's CPU accelerator presents it; communication over gloo."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    def __init__(self):
        self._peak_rss = 0  # bytes: reset_max_memory_allocated sets it to the current resident set

    def is_synchronized_device(self) -> bool:
        return True

    use_host_timers = resolves_data_dependency = handles_memory_backpressure = is_synchronized_device

    def random(self):
        return torch.random

    def is_fp64_supported(self) -> bool:
        return True

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def device_name(self, device_index=None) -> str:
        return "cpu"

    def device(self, device_index=None):
        return None

    def set_device(self, device_index) -> None:
        return None

    def current_device(self) -> int:
        """The local rank (DeepSpeed's CPU accelerator: one "device" per rank of the node)."""
        return read_launch_env(os.environ).local_rank

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """The ranks on this node (DeepSpeed's CPU accelerator reads its launcher's LOCAL_SIZE; here any
        launcher's local world size, 1 in a single process)."""
        return read_launch_env(os.environ).local_world_size

    def synchronize(self, device_index=None) -> None:
        return None

    def set_rng_state(self, new_state, device_index=None):
        return torch.set_rng_state(new_state)

    def get_rng_state(self, device_index=None):
        return torch.get_rng_state()

    def manual_seed(self, seed):
        return torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def default_generator(self, device_index):
        return torch.default_generator

    Stream = property(lambda self: None)
    Event = property(lambda self: None)

    def stream(self, stream):
        return contextlib.nullcontext()

    def current_stream(self, device_index=None):
        return None

    default_stream = current_stream

    def empty_cache(self) -> None:
        return None

    @staticmethod
    def _rss() -> int:
        """The process's resident set in bytes (/proc/self/statm; the peak so far where it is missing)."""
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def memory_allocated(self, device_index=None) -> int:
        rss = self._rss()
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def max_memory_allocated(self, device_index=None) -> int:
        self.memory_allocated()
        return self._peak_rss

    def reset_max_memory_allocated(self, device_index=None) -> None:
        self._peak_rss = self._rss()

    memory_cached = memory_reserved = memory_allocated
    max_memory_cached = max_memory_reserved = max_memory_allocated
    reset_max_memory_cached = reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index=None) -> dict:
        return {"allocated_bytes.all.current": self.memory_allocated(),
                "allocated_bytes.all.peak": self._peak_rss}

    def total_memory(self, device_index=None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index=None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True  # torch computes fp16 on the CPU (slowly); megazero's CPU tests use it

    def supported_dtypes(self) -> list:
        return [torch.float, torch.bfloat16, torch.half]

    def is_available(self) -> bool:
        return True

    def range_push(self, msg, domain=None, category=None):
        return None

    def range_pop(self, domain=None):
        return None

    def lazy_call(self, callback):
        return callback()

    def is_current_stream_capturing(self) -> bool:
        return False

    def create_graph(self):
        return None

    def capture_to_graph(self, graph, pool=None, stream=None):
        return contextlib.nullcontext()

    def replay_graph(self, graph) -> None:
        return None

    def pin_memory(self, tensor, make_copy=True, match_shape=True):
        return tensor  # nothing to pin a host tensor for

    def is_pinned(self, tensor) -> bool:
        return tensor.is_pinned() if torch.cuda.is_available() else False

    def on_accelerator(self, tensor) -> bool:
        return tensor.device.type == "cpu"


def _accelerator(kind: str) -> _Accelerator:
    """The process's accelerator of device type `kind` (one each per process, as DeepSpeed's one, kept in
    the compat registry; the CPU one's peak-memory meter is its only state)."""
    made = registry().accelerators
    if kind not in made:
        made[kind] = CudaAccelerator() if kind == "cuda" else CpuAccelerator()
    return made[kind]


def _backend() -> str:
    """The backend the device is decided for: ``DS_ACCELERATOR``'s (cpu: gloo, cuda: nccl) when set, else
    the default group's once it exists (the engine's device follows it), else "auto"."""
    name = os.environ.get("DS_ACCELERATOR")
    if name is not None:
        if name not in SUPPORTED:
            raise ValueError(f"DS_ACCELERATOR={name!r}: megazero runs on {' or '.join(SUPPORTED)}; unset it or "
                             f"pick one")
        if name == "cuda" and visible_cuda_devices() == 0:
            raise ValueError("DS_ACCELERATOR=cuda, but torch sees no CUDA device; unset it to use the CPU")
        return "gloo" if name == "cpu" else "nccl"
    if dist.is_available() and dist.is_initialized():
        return "nccl" if "nccl" in dist.get_backend() else "gloo"
    return "auto"


def get_accelerator():
    """The process's accelerator for the device `compute_device` gives this process (module docstring):
    CUDA or the CPU."""
    return _accelerator(compute_device(read_launch_env(os.environ), _backend()).type)


def is_current_accelerator_supported() -> bool:
    """DeepSpeed's check: whether the selected accelerator is one megazero runs on (always, once chosen)."""
    return get_accelerator()._name in SUPPORTED


def set_accelerator(accel_obj) -> None:
    """Refused: megazero's accelerator follows the engine's device (`compute_device`, or DS_ACCELERATOR)."""
    raise NotImplementedError("set_accelerator: megazero's accelerator is the engine's device (CUDA or the CPU); "
                              "set DS_ACCELERATOR=cuda|cpu instead")


__all__ = ["get_accelerator", "set_accelerator", "is_current_accelerator_supported", "CudaAccelerator",
           "CpuAccelerator"]
