"""Measured memory: activations saved for backward (per layer and peak per stage) and the combined report.

`SavedActivationMeter` installs `torch.autograd.graph.saved_tensors_hooks` and sees every tensor
autograd keeps for backward while it is active (forward and backward of a pipeline step alike):

* It counts unique storages, by their full size: a saved view of a bigger buffer holds that buffer,
  and two saves of one storage (a LayerNorm output feeding q, k and v) hold it once. A storage leaves
  the count when the last saved tensor on it is released by autograd (after its node's backward).
* Parameters (and views of them, such as a transposed weight) are model state, not activations: they
  are not counted.
* Bytes are "host" for tensors tagged with `megazero.activation_checkpoint.HOST_TAG` (CPU
  checkpoints, also in CPU-only runs where host and device are one memory) or on the CPU while the
  model computes on an accelerator; the rest are "device".
* Per layer: bytes of storages first saved while that layer's forward runs (labels ``embedding``,
  ``layers.<i>``, ``head``; ``other`` outside any layer, e.g. the loss), summed over the measured
  window. Measure one micro-batch's forward for per-layer, per-micro-batch figures.
* Peak: the most bytes alive at once during the window, per kind and in total: over a pipeline
  step, the in-flight activations of this stage.

Tensors inside an activation-checkpoint region are replaced by placeholders (the region's own hooks
are innermost), so they are not counted; the checkpoint's kept input is, through the region's anchor.
The tensors a recompute rebuilds are counted as kind "recompute" (device memory, alive from the
recompute until backward uses them) when the meter is given the model: it registers with the
model's ``activation_checkpointer``. Peaks: "device" and "host" (kept for backward: the in-flight
activations), "recompute" (the recompute working set), "device_total" (device + recompute) and
"total".

Under any saved-tensor hooks (this meter's, a checkpoint region's) autograd hands unpacked saved
tensors back as new tensor objects: a saved parameter returns as a plain tensor on the parameter's
storage. Backward code must not identify parameters by their unpacked saved tensors.
"""
from __future__ import annotations

import contextlib
import gc
import threading

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megazero.activation_checkpoint import HOST_TAG, CheckpointedBlock
from megazero.models import CausalLM, EmbeddingLayer, HeadLayer, TransformerBlock
from megazero.pipeline.pipeline_module import PipelineModule

KINDS = ("device", "host", "recompute")


def layer_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(label, module) of each layer: a PipelineModule's local layers, a CausalLM's stages, else the model."""
    if isinstance(model, PipelineModule):
        mods = [m for chunk in model.local_chunks for m in chunk]
    elif isinstance(model, CausalLM):
        mods = list(model.stages())
    else:
        mods = [model]
    return [(_label(m), m) for m in mods]


def _label(mod: nn.Module) -> str:
    if isinstance(mod, (TransformerBlock, CheckpointedBlock)) and mod.index is not None:
        return f"layers.{mod.index}"
    if isinstance(mod, EmbeddingLayer):
        return "embedding"
    if isinstance(mod, HeadLayer):
        return "head"
    return type(mod).__name__


def _is_param(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


class _Held:
    """What the meter's pack hook returns: the tensor, and a release of its storage count on deletion."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor, meter, key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        if self.key is not None:
            self.meter._drop(self.key)


class SavedActivationMeter:
    """Measures saved-for-backward bytes while active (``with meter:``); see the module docstring.

    Args:
        model: whose layers label the per-layer counts (optional).
        device: the compute device (default: the model's first parameter's, else CPU).
        checkpointer: the model's `ActivationCheckpointer`, if any (its recomputes count as the
            recompute working set).
    """

    def __init__(self, model=None, device=None, checkpointer=None):
        self.layers = layer_modules(model) if model is not None else []
        self.checkpointer = checkpointer
        if device is None and model is not None:
            device = next((p.device for p in model.parameters()), None)
        self.device = torch.device(device if device is not None else "cpu")
        self._lock = threading.Lock()
        self._stack: list[str] = []
        self._handles: list = []
        self._hooks = None
        self._live: dict = {}  # storage key -> [saved tensors on it, bytes, kind]
        self.live = {k: 0 for k in KINDS}
        self.reset()

    def reset(self) -> None:
        """Forget peaks and per-layer counts (storages still alive stay counted as live)."""
        with self._lock:
            self.peak = {k: 0 for k in KINDS} | {"device_total": 0, "total": 0}
            self.per_layer: dict[str, dict[str, int]] = {}
            self._update_peak()

    # -- activation -------------------------------------------------------------------------------
    def __enter__(self) -> "SavedActivationMeter":
        for label, mod in self.layers:
            self._handles.append(mod.register_forward_pre_hook(self._push(label)))
            self._handles.append(mod.register_forward_hook(self._pop, always_call=True))
        if self.checkpointer is not None:
            self.checkpointer.observers.append(self)
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
        if self.checkpointer is not None:
            self.checkpointer.observers.remove(self)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def measure(self):
        """``with meter.measure():`` resets the counts, then measures the block."""
        self.reset()
        with self:
            yield self

    def _push(self, label):
        def hook(mod, args):
            self._stack.append(label)
        return hook

    def _pop(self, mod, args, out):
        if self._stack:
            self._stack.pop()

    # -- hooks ------------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> _Held:
        host = getattr(t, HOST_TAG, False) or (t.device.type == "cpu" and self.device.type != "cpu")
        return self._count(t, "host" if host else "device", self._stack[-1] if self._stack else "other")

    def hold(self, t: torch.Tensor) -> _Held:
        """Count `t`, rebuilt by a checkpoint recompute, until the returned holder is dropped."""
        return self._count(t, "recompute", None)

    def _count(self, t: torch.Tensor, kind: str, label: str | None) -> _Held:
        if _is_param(t) or t.layout != torch.strided:
            return _Held(t, self, None)
        storage = t.untyped_storage()
        key = (str(t.device), storage._cdata)  # the storage itself (meta storages all have data_ptr 0)
        with self._lock:
            entry = self._live.get(key)
            if entry is not None:
                entry[0] += 1
            else:
                n = storage.nbytes()
                self._live[key] = [1, n, kind]
                self.live[kind] += n
                if label is not None:
                    layer = self.per_layer.setdefault(label, {k: 0 for k in KINDS[:2]})
                    layer[kind] += n
                self._update_peak()
        return _Held(t, self, key)

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    def _drop(self, key) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                del self._live[key]
                self.live[entry[2]] -= entry[1]

    def _update_peak(self) -> None:
        for k in KINDS:
            self.peak[k] = max(self.peak[k], self.live[k])
        self.peak["device_total"] = max(self.peak["device_total"], self.live["device"] + self.live["recompute"])
        self.peak["total"] = max(self.peak["total"], sum(self.live.values()))

    # -- results ----------------------------------------------------------------------------------
    def layer_bytes(self, kind: str = "device") -> dict[str, int]:
        """{label: bytes of `kind` ("device", "host" or "total" of both) kept for backward} over the window."""
        if kind == "total":
            return {label: sum(v.values()) for label, v in self.per_layer.items()}
        return {label: v[kind] for label, v in self.per_layer.items()}

    def report(self) -> dict:
        """{"peak_<kind>" for each peak, "live_<kind>" for each kind, "per_layer"}."""
        with self._lock:
            return ({f"peak_{k}": v for k, v in self.peak.items()} | {f"live_{k}": v for k, v in self.live.items()}
                    | {"per_layer": {k: dict(v) for k, v in self.per_layer.items()}})


def memory_report(optimizer=None, meter: SavedActivationMeter | None = None, checkpointer=None) -> dict[str, int]:
    """This rank's memory in bytes, by kind: the ZeRO optimizer's model states (`memory_breakdown`:
    params, grads, master, optimizer_states, comm_buffers), the activations a `meter` saw at their peak
    (``activations``: device bytes kept for backward plus the recompute working set;
    ``activations_host``: host checkpoints), and a checkpointer's contiguous buffer (``checkpoint_buffer``)."""
    out: dict[str, int] = dict(optimizer.memory_breakdown()) if optimizer is not None else {}
    if meter is not None:
        out["activations"] = meter.peak["device_total"]
        out["activations_host"] = meter.peak["host"]
    pool = checkpointer.pool if checkpointer is not None else None
    if pool is not None:
        out["checkpoint_buffer"] = pool.nbytes
    return out


class LiveTensorBytes(TorchDispatchMode):
    """The peak bytes of tensor storages alive at once while active: the CPU's ``max_memory_allocated``
    (on a CPU torch keeps no such count), what the planner's memory prediction is measured against.

    With `seed` (the default) it starts from every storage alive on entry (each tensor object Python holds,
    and its ``.grad``: parameters, gradients, optimizer states, flat buffers, kept activations); while
    active it adds every storage an operator creates (forward, backward and the optimizer alike: CPU
    backward runs on the calling thread), each once (views share it), until the last tensor on it is gone
    (`StorageWeakRef`); a storage resized in place (ZeRO-3's gathered buckets) at its new size from the next
    operator that outputs it or the next sweep. Not counted: memory outside torch tensors (gloo's own buffers, the allocator's
    rounding). `peak` is the most alive at once, `current()` what is alive now."""

    def __init__(self, seed: bool = True):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage address -> (weak ref, bytes)
        self.total = 0
        self.peak = 0
        self._since_sweep = 0
        self._seed = seed

    def __enter__(self):
        if self._seed:
            gc.collect()  # tensors in unreachable cycles are not alive
            for obj in gc.get_objects():
                if issubclass(type(obj), torch.Tensor):  # (not isinstance: some objects warn on __class__)
                    for t in (obj, obj.grad if obj.is_leaf else None):
                        if isinstance(t, torch.Tensor) and t.device.type != "meta":
                            self._track(t, sweep=False)  # one sweep below, not one per seeded storage (quadratic)
            self.sweep()
            self.peak = self.total
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor, sweep: bool = True) -> None:
        """Count `t`'s storage once; with `sweep`, sweep when the total passes the peak or every 2000 storages."""
        storage = t.untyped_storage()
        key = storage._cdata
        held = self.live.get(key)
        nbytes = storage.nbytes()
        if held is not None and not held[0].expired():
            if nbytes == held[1]:
                return
            self.live[key] = (held[0], nbytes)  # resized in place (ZeRO-3's gathered buckets grow back)
            self.total += nbytes - held[1]
        else:
            if held is not None:  # a freed storage's address reused
                self.total -= held[1]
            self.live[key] = (StorageWeakRef(storage), nbytes)
            self.total += nbytes
        self._since_sweep += 1
        if sweep and (self.total > self.peak or self._since_sweep > 2000):
            self.sweep()
            self.peak = max(self.peak, self.total)

    def sweep(self) -> None:
        """Forget storages whose last tensor is gone; take the size of every other one again (a storage can be
        resized in place, ``untyped_storage().resize_``, with no operator: ZeRO-3 frees a gathered bucket's
        bytes that way and grows them back)."""
        for k, (ref, held) in list(self.live.items()):
            if ref.expired():
                self.total -= self.live.pop(k)[1]
                continue
            nbytes = torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
            if nbytes != held:
                self.live[k] = (ref, nbytes)
                self.total += nbytes - held
        self._since_sweep = 0

    def current(self) -> int:
        self.sweep()
        return self.total
