"""Counting the host synchronisations a piece of code makes, on any device, CPU included.

On a GPU the host runs ahead of the device: it queues kernels and returns. Anything that needs a
value on the host (`.item()`, `float(t)`, `.tolist()`, `if t:`), or a shape that depends on values
(`nonzero`, boolean-mask indexing, `unique`, `repeat_interleave` without `output_size`, `bincount`,
whose CUDA kernel reads the maximum), or a device-to-host copy, makes the host wait for every kernel
queued before it. Once per step is harmless; once per micro-batch or per layer stalls the pipeline
of launches and shows as idle gaps on the GPU. `torch.cuda.set_sync_debug_mode("warn")` finds them
only on a GPU; `SyncCounter` finds them on CPU, through the dispatcher, so a CPU test can forbid them.

    with SyncCounter() as syncs:
        engine.train_batch(data)
    assert syncs.count == 0, syncs.report()

Each event is recorded with its kind and the innermost megazero source line that caused it (or the
caller's, outside megazero). Host copies are seen only where tensors live on a non-CPU device (a CPU
run has none). No communication; the counter is a TorchDispatchMode, active on this thread only.
"""
from __future__ import annotations

import collections
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# operations whose result the host must read, or whose output shape depends on values
_VALUE_OPS = {
    aten._local_scalar_dense.default: "item",  # .item(), float(t), int(t), bool(t), t.tolist() per element
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten.bincount.default: "bincount",  # CUDA sizes its output from the input's maximum
    aten.equal.default: "equal",
    aten.is_nonzero.default: "is_nonzero",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
}
_HERE = os.path.abspath(__file__)
_PACKAGE = os.path.dirname(os.path.dirname(_HERE))


def _kind(func, args, kwargs) -> str | None:
    """The kind of host synchronisation `func(*args, **kwargs)` makes, or None."""
    if func in _VALUE_OPS:
        return _VALUE_OPS[func]
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(i is not None and i.dtype == torch.bool for i in indices):
            return "boolean mask index"
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None and (len(args) < 2 or args[1] is None):
        return "repeat_interleave without output_size"
    if func in (aten._to_copy.default, aten.copy_.default):  # a non_blocking copy (into pinned memory) waits not
        copy = func is aten.copy_.default
        if (args[2] if copy and len(args) > 2 else kwargs.get("non_blocking", False)):
            return None
        src = args[1] if copy else args[0]
        dst = args[0].device if copy else kwargs.get("device")
        if dst is not None and isinstance(src, torch.Tensor) and src.device.type not in ("cpu", "meta") \
                and torch.device(dst).type == "cpu":
            return "device-to-host copy"
    return None


def call_site() -> str:
    """'file:line' of the innermost frame in megazero outside this file (else the first outside torch)."""
    frame = sys._getframe(2)
    fallback = None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _HERE and "torch" + os.sep not in path:
            where = f"{os.path.relpath(path, os.path.dirname(_PACKAGE))}:{frame.f_lineno}"
            if path.startswith(_PACKAGE + os.sep):
                return where
            fallback = fallback or where
        frame = frame.f_back
    return fallback or "?"


class SyncCounter(TorchDispatchMode):
    """See the module docstring. `count`: synchronisations seen; `events`: (kind, site) of each, in
    order; `report()`: a summary by site. `Tensor.tolist` (which does not dispatch) is wrapped while
    active and counts once per call."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, str]] = []
        self._tolist = None

    @property
    def count(self) -> int:
        return len(self.events)

    def by_site(self) -> collections.Counter:
        return collections.Counter(f"{site} ({kind})" for kind, site in self.events)

    def report(self) -> str:
        if not self.events:
            return "no host synchronisation"
        return f"{self.count} host synchronisations:\n" + "\n".join(
            f"  {n} x {where}" for where, n in self.by_site().most_common())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _kind(func, args, kwargs)
        if kind is not None and not getattr(self, "_in_tolist", False):
            self.events.append((kind, call_site()))
        return func(*args, **kwargs)

    def __enter__(self):
        original = torch.Tensor.tolist
        counter = self

        def tolist(t):
            if t.device.type != "meta":
                counter.events.append(("tolist", call_site()))
            counter._in_tolist = True
            try:
                return original(t)
            finally:
                counter._in_tolist = False

        self._tolist = original
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


__all__ = ["SyncCounter", "call_site"]
