"""Where a checkpoint's kept inputs live between the forward and the recompute.

`CheckpointStore.save(inputs)` keeps each input tensor in one of these forms, chosen by the config keys
of ``activation_checkpointing``:

* plain: a detached reference (no copy; the tensor's own storage stays alive).
* ``partition_activations``: the flattened input is padded to a multiple of t = tp_group.size and
  split in t equal chunks; TP rank r keeps chunk r (numel/t elements). `load` all-gathers the chunks
  over `tp_group` through `megazero.runtime.comm` (so ``tp_group.stats`` counts it: (t−1)·numel/t elements).
  The TP ranks hold identical layer inputs (no sequence parallelism), so nothing is lost.
* ``cpu_checkpointing``: the kept tensor is copied to host memory (pinned, copied asynchronously, when
  the input is on a GPU) and copied back in `load`. The host copy carries the attribute `HOST_TAG`, by
  which megazero.run.memory counts it as host bytes even in CPU-only runs, where "device" and host are the
  same memory but the code path is the same.
* ``contiguous_memory_optimization``: the kept tensors are copied into slots of one `ContiguousPool`
  per stage (one preallocated buffer, on the host with cpu_checkpointing), instead of separate
  allocations, so checkpoints do not fragment the allocator.

Recomputed inputs get the ``requires_grad`` flag of the originals (the recompute must save the same
tensors as the forward did).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from megazero.runtime import comm
from megazero.runtime.comm import GroupHandle

HOST_TAG = "megazero_host_checkpoint"


@dataclass(eq=False)
class Stored:
    """One region run's kept inputs: `kept[i]` holds input i in the store's form."""

    kept: list
    shapes: list
    requires_grad: list
    device: torch.device
    slots: list = field(default_factory=list)
    finalizer: object = None


class ContiguousPool:
    """One buffer of `slots` equal slots (allocated at the first `acquire`, when the slot size is known).

    `acquire(numel, dtype)` returns (slot, a view of numel elements); `release(slot)` frees it. Every
    checkpoint must have the same size; a full pool is an error that names number_checkpoints.
    """

    def __init__(self, slots: int, host: bool, what: str = "activation_checkpointing.number_checkpoints"):
        if slots < 1:
            raise ValueError(f"{what}: the contiguous checkpoint buffer needs at least one slot, got {slots}")
        self.slots, self.host, self.what = slots, host, what
        self.buffer: torch.Tensor | None = None
        self.slot_numel = 0
        self.free_slots: list[int] = []

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device) -> tuple[int, torch.Tensor]:
        if self.buffer is None:
            where = torch.device("cpu") if self.host else device
            pin = self.host and device.type == "cuda"
            self.buffer = torch.empty(self.slots * numel, dtype=dtype, device=where, pin_memory=pin)  # (slots·numel,)
            setattr(self.buffer, HOST_TAG, self.host)
            self.slot_numel, self.free_slots = numel, list(range(self.slots - 1, -1, -1))
        if numel != self.slot_numel or dtype != self.buffer.dtype:
            raise ValueError(f"activation_checkpointing.contiguous_memory_optimization: a checkpoint of {numel} "
                             f"{dtype} elements does not fit the buffer's slots of {self.slot_numel} "
                             f"{self.buffer.dtype} elements; every checkpoint must have the same shape")
        if not self.free_slots:
            raise RuntimeError(f"{self.what}: all {self.slots} slots of the contiguous checkpoint buffer are in use; "
                               f"the buffer holds number_checkpoints x the micro-batches in flight on this stage")
        slot = self.free_slots.pop()
        return slot, self.buffer[slot * numel:(slot + 1) * numel]

    def release(self, slot: int) -> None:
        self.free_slots.append(slot)

    def in_use(self) -> int:
        return 0 if self.buffer is None else self.slots - len(self.free_slots)


class CheckpointStore:
    """Keeps checkpointed region inputs (see the module docstring). Communicates only in `load` with
    `partition`: an all-gather over `tp_group`."""

    def __init__(self, tp_group: GroupHandle, partition: bool = False, cpu: bool = False,
                 pool: ContiguousPool | None = None, stats=None):
        self.tp_group, self.partition, self.cpu, self.pool, self.stats = tp_group, partition, cpu, pool, stats

    def save(self, inputs) -> Stored:
        device = inputs[0].device
        st = Stored([], [tuple(x.shape) for x in inputs], [x.requires_grad for x in inputs], device)
        for x in inputs:
            st.kept.append(self._keep(x.detach(), st))
        if st.slots:
            st.finalizer = weakref.finalize(st, _release_slots, self.pool, list(st.slots))
        if self.stats is not None:
            self.stats.kept_bytes += sum(k.numel() * k.element_size() for k in st.kept)
        return st

    def _keep(self, x: torch.Tensor, st: Stored) -> torch.Tensor:
        if not (self.partition or self.cpu or self.pool is not None):
            return x
        src = self._my_chunk(x) if self.partition else x.reshape(-1)  # (numel/t,) or (numel,)
        if self.pool is not None:
            slot, dst = self.pool.acquire(src.numel(), src.dtype, src.device)
            st.slots.append(slot)
        elif self.cpu:
            dst = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=src.is_cuda)
        else:
            dst = torch.empty_like(src)
        dst.copy_(src, non_blocking=src.is_cuda and dst.device.type == "cpu")
        if self.cpu:
            setattr(dst, HOST_TAG, True)
        return dst

    def _my_chunk(self, x: torch.Tensor) -> torch.Tensor:
        t, r = self.tp_group.size, self.tp_group.rank
        flat = x.reshape(-1)  # (numel,)
        per = -(-flat.numel() // t)
        if per * t != flat.numel():
            flat = torch.nn.functional.pad(flat, (0, per * t - flat.numel()))  # (t·per,)
        return flat[r * per:(r + 1) * per]

    def load(self, st: Stored) -> tuple:
        """The inputs again (detached, with their original requires_grad), on their device."""
        out = []
        for kept, shape, rg in zip(st.kept, st.shapes, st.requires_grad):
            x = kept.to(st.device, non_blocking=True) if kept.device != st.device else kept
            if self.partition:
                full = torch.empty(x.numel() * self.tp_group.size, dtype=x.dtype, device=x.device)  # (t·per,)
                comm.all_gather(full, x.contiguous(), self.tp_group)
                if self.stats is not None:
                    self.stats.gathered_bytes += (self.tp_group.size - 1) * x.numel() * x.element_size()
                x = full
            numel = 1
            for d in shape:
                numel *= d
            out.append(x.reshape(-1)[:numel].view(shape).detach().requires_grad_(rg))
        return tuple(out)

    def free(self, st: Stored) -> None:
        """Drop the kept tensors and give contiguous slots back."""
        st.kept = []
        if st.finalizer is not None:
            st.finalizer()


def _release_slots(pool: ContiguousPool, slots: list) -> None:
    for s in slots:
        pool.release(s)
