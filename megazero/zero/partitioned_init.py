"""DeepSpeed's `zero.Init` and `zero.GatheredParameters`: building a model too big for one rank, and
reaching its full parameters when a script needs them.

`Init` (a context manager): every `nn.Module` whose constructor finishes inside it keeps, of each
parameter it created, only this rank's *partition*: the r-th of dp_size equal contiguous pieces of
the flattened tensor (the last padded), on this rank's GPU (`local_device`; the host with
``remote_device="cpu"`` or without CUDA), so that the all-gathers and broadcasts below run on NCCL. The constructor still creates and initializes each
parameter in full, so the values are exactly those of a build without Init (same seed, same
order), but only one submodule's parameters exist in full at a time. The full shape is kept as
``param.zero_init_shape`` and the partition as ``param.zero_init_partition`` = (rank, size).

The ZeRO optimizer (`megazero.zero.flat_group.FlatGroup`) builds its flat buffers from such
parameters one at a time: `full_value` all-gathers one parameter over the dp group, the group keeps
what it owns, the rest is freed. The dp group must be the one Init partitioned over (the world, as
DeepSpeed's default; ZeRO under ModuleEngine has tp = pp = 1).

`GatheredParameters(params, modifier_rank=None)`: inside the block the given parameters hold their
full values on every rank (all-gathered over dp); with `modifier_rank`, what that rank writes is
broadcast and kept when the block ends. Works for parameters still partitioned by Init and for
parameters a ZeRO optimizer holds (`ZeroOptimizer.full_parameters`).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from megazero.runtime import comm
from megazero.runtime.comm import GroupHandle


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_partitioned(p: torch.Tensor) -> bool:
    return getattr(p, "zero_init_shape", None) is not None


def full_shape(p: torch.Tensor) -> torch.Size:
    """The shape of `p` as the model defines it (a partitioned parameter's full shape)."""
    return torch.Size(p.zero_init_shape) if is_partitioned(p) else p.shape


def local_device(remote_device: str | None) -> torch.device:
    """Where `Init` keeps partitions, as DeepSpeed: the host with ``remote_device="cpu"``, else this
    process's accelerator (torch's current CUDA device: the launcher set it to the local rank's), else
    the host."""
    if remote_device != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def partition(p: torch.Tensor, rank: int, size: int, device: torch.device | None = None) -> None:
    """Keep only partition `rank` of `size` of parameter `p` (contiguous, ceil(numel / size) each), on
    `device` (default: where `p` is)."""
    flat = p.data.reshape(-1)  # (numel,)
    chunk = math.ceil(flat.numel() / size)
    lo, hi = min(flat.numel(), rank * chunk), min(flat.numel(), (rank + 1) * chunk)
    shape = tuple(p.shape)
    p.data = flat[lo:hi].to(device if device is not None else flat.device, copy=True)
    p.zero_init_shape, p.zero_init_partition = shape, (rank, size)


def full_value(p: torch.Tensor, group: GroupHandle) -> torch.Tensor:
    """The full value of a parameter partitioned by `Init` (an all-gather over `group`, which must be
    the group it was partitioned over: every member calls this for the same parameter)."""
    rank, size = p.zero_init_partition
    if (rank, size) != (group.rank, group.size):
        raise RuntimeError(f"a parameter built under zero.Init as partition {rank} of {size} reached a group where "
                           f"this rank is {group.rank} of {group.size}; zero.Init partitions over the world "
                           "(data parallel only: tp = pp = 1)")
    n = math.prod(p.zero_init_shape)
    chunk = math.ceil(n / size)
    mine = torch.zeros(chunk, dtype=p.dtype, device=p.device)
    mine[:p.data.numel()].copy_(p.data)
    out = torch.empty(chunk * size, dtype=p.dtype, device=p.device)
    comm.all_gather(out, mine, group)
    return out[:n].view(p.zero_init_shape)


def _subclasses(cls) -> list[type]:
    out, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            out.append(sub)
            todo.append(sub)
    return out


def _refuse_hugging_face(module: nn.Module) -> None:
    """Hugging Face models re-initialise every weight in `post_init`, after their submodules are
    built (and here partitioned): on partitions that would draw the same values on every rank, or
    index the wrong elements. DeepSpeed relies on code inside transformers for this; megazero
    refuses rather than build a wrongly initialised model."""
    if any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers") for c in type(module).__mro__):
        raise NotImplementedError(
            f"zero.Init: {type(module).__name__} is a Hugging Face model, whose post_init re-initialises the weights "
            "after its submodules are built; megazero's Init does not intercept that yet. Build it without "
            "zero.Init (megazero.initialize then shards it at ZeRO-3), or convert it to a megazero model "
            "(tools/convert_checkpoint.py from-hf) and build that under zero.Init")


class Init:
    """See the module docstring. DeepSpeed's arguments are accepted; the ones megazero cannot honour
    (an NVMe `remote_device`, another `data_parallel_group` than the world, `mpu`) are refused by
    name. `enabled=False` builds normally. `module=` partitions an already built module."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group=None, mem_efficient_linear: bool = True,
                 remote_device: str | None = None, pin_memory: bool = False, config_dict_or_path=None,
                 config=None, enabled: bool = True, dtype=None, mpu=None, sequence_data_parallel_group=None,
                 param_swapper=None):
        if remote_device not in (None, "cpu", "none"):
            raise ValueError(f"zero.Init(remote_device={remote_device!r}): only None or 'cpu' (NVMe offload is not "
                             "supported yet)")
        for name, value in (("mpu", mpu), ("sequence_data_parallel_group", sequence_data_parallel_group),
                            ("param_swapper", param_swapper)):
            if value is not None:
                raise ValueError(f"zero.Init({name}=...): not supported; megazero partitions over the world")
        if data_parallel_group is not None and dist.get_world_size(data_parallel_group) != _world()[1]:
            raise ValueError("zero.Init(data_parallel_group=...): megazero partitions over the world group only")
        self.enabled, self.dtype = enabled, dtype
        self.device = local_device(remote_device)
        self.rank, self.size = _world()
        self._originals: dict[type, object] = {}
        self._depth: dict[int, int] = {}
        if module is not None and enabled:
            for m in module.modules():
                self._partition(m)

    def _partition(self, module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            if not is_partitioned(p):
                if self.dtype is not None and p.is_floating_point():
                    p.data = p.data.to(self.dtype)
                partition(p, self.rank, self.size, self.device)

    def _wrap(self, cls) -> None:
        if "__init__" not in cls.__dict__ or cls in self._originals:
            return
        original = cls.__dict__["__init__"]
        self._originals[cls] = original
        init = self

        def __init__(module, *args, **kwargs):
            key = id(module)
            if key not in init._depth:
                _refuse_hugging_face(module)
            init._depth[key] = init._depth.get(key, 0) + 1
            try:
                original(module, *args, **kwargs)
            finally:
                init._depth[key] -= 1
            if init._depth[key] == 0:  # the outermost constructor of this module has finished
                del init._depth[key]
                init._partition(module)

        __init__.__wrapped__ = original
        cls.__init__ = __init__

    def __enter__(self):
        if not self.enabled:
            return self
        for cls in _subclasses(nn.Module):
            self._wrap(cls)
        init = self
        self._subclass_hook = nn.Module.__dict__.get("__init_subclass__")

        @classmethod
        def __init_subclass__(cls, **kwargs):  # classes defined inside the block are wrapped too
            super(nn.Module, cls).__init_subclass__(**kwargs)
            init._wrap(cls)

        nn.Module.__init_subclass__ = __init_subclass__
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        for cls, original in self._originals.items():
            cls.__init__ = original
        self._originals.clear()
        if self._subclass_hook is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._subclass_hook
        return False


class GatheredParameters:
    """See the module docstring. `params`: one parameter or an iterable of them. Collective over the
    dp group (the world): every rank enters the block with the same parameters."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank, self.enabled = modifier_rank, enabled
        self._held = []
        self._context = None

    def __enter__(self):
        if not self.enabled:
            return self
        self.group = comm.world_group()
        refs = [getattr(p, "zero_optimizer", None) for p in self.params]
        owners = {id(o): o for o in (r() for r in refs if r is not None) if o is not None}
        if len(owners) > 1:
            raise ValueError("GatheredParameters: the parameters belong to different ZeRO optimizers; gather each "
                             "optimizer's parameters in a block of their own")
        if owners:
            (opt,) = owners.values()
            self._context = opt.full_parameters(params=self.params, modifier_rank=self.modifier_rank)
            self._context.__enter__()
        for p in self.params:
            if is_partitioned(p):
                self._held.append((p, p.data, p.zero_init_shape, p.zero_init_partition))
                p.data = full_value(p, self.group).clone()
                p.zero_init_shape = None
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        for p, _, shape, (rank, size) in self._held:
            if self.modifier_rank is not None:
                comm.broadcast(p.data, self.modifier_rank, self.group)
            partition(p, rank, size)
        self._held.clear()
        if self._context is not None:
            self._context.__exit__(*exc)
        return False
