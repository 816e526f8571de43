"""Reproducible dropout under tensor parallelism: named RNG streams and a dropout with mask injection.

`RNGStatesTracker` holds named random streams, each an explicit `torch.Generator` per device ("cpu",
"cuda:<i>"; created and seeded on first use, so CPU and CUDA are both covered) seeded from the model seed:

* ``"tensor-parallel"`` (`TP_STREAM`): seeded with (seed, tp_rank, pp_rank). Used where each TP rank
  holds a different part of the activation: attention probabilities of its own heads, and, under
  sequence parallelism, hidden activations of its own sequence chunk. Masks differ across TP ranks.
* ``"replicated"`` (`REPLICATED_STREAM`): seeded with (seed, pp_rank), the same on every TP rank.
  Used on activations that every TP rank holds in full (hidden states without sequence
  parallelism), so the replicas stay identical.

Dropout draws masks with ``bernoulli_(generator=...)`` and never touches the global RNG, so two runs
with the same seed are bit-identical. Activation recomputation replays masks by saving
``tracker.get_states()`` before the forward and restoring it with ``set_states`` before the recompute.

Mask injection (how "tp=2 equals tp=1 with the same masks" is testable): every `Dropout` module has a
``site`` (a layout-independent name such as ``"layers.3.attn.probs_dropout"``) and knows how its
local tensor relates to the logical full activation (`ShardInfo`: this rank's chunk along a dim, or
None when it holds the full tensor). `set_dropout_mask_fn(model, fn)` installs ``fn(site, shape, shard)
-> keep-mask`` on every Dropout module; `LogicalMaskFn` is such a function: it draws the mask of the
*full logical* activation from (seed, site, call number) and returns this rank's slice, so every
layout applies exactly the same masks to the same logical elements.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from megazero.tensor_parallel.init import stable_seed

TP_STREAM = "tensor-parallel"
REPLICATED_STREAM = "replicated"


def _device_key(device) -> str:
    """"cpu" or "cuda:<index>" (the current device when none is given)."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


class RNGStatesTracker:
    """Named random streams (see the module docstring). Not shared between processes."""

    def __init__(self, seed: int = 0, tp_rank: int = 0, pp_rank: int = 0):
        self.seeds: dict[str, int] = {}
        self._gens: dict[tuple[str, str], torch.Generator] = {}
        self.add(TP_STREAM, stable_seed("dropout", seed, "tp", tp_rank, pp_rank))
        self.add(REPLICATED_STREAM, stable_seed("dropout", seed, "replicated", pp_rank))

    @classmethod
    def of_streams(cls, streams: dict[str, int]) -> "RNGStatesTracker":
        """A tracker of exactly `streams` (name -> seed), without the model's two: for callers that add
        their own by name (DeepSpeed's `get_cuda_rng_tracker`, `megazero.compat.activation_api`)."""
        tracker = cls.__new__(cls)
        tracker.seeds, tracker._gens = {}, {}
        for name, seed in streams.items():
            tracker.add(name, seed)
        return tracker

    def add(self, name: str, seed: int) -> None:
        """Register stream `name` with `seed` (an error if the name exists)."""
        if name in self.seeds:
            raise ValueError(f"RNG stream {name!r} already exists; streams: {sorted(self.seeds)}")
        self.seeds[name] = int(seed)

    def generator(self, name: str, device) -> torch.Generator:
        """The generator of stream `name` on `device`, created and seeded on first use."""
        if name not in self.seeds:
            raise KeyError(f"unknown RNG stream {name!r}; streams: {sorted(self.seeds)}")
        key = (name, _device_key(device))
        gen = self._gens.get(key)
        if gen is None:
            gen = torch.Generator(device=key[1]).manual_seed(self.seeds[name])
            self._gens[key] = gen
        return gen

    def get_states(self) -> dict[tuple[str, str], torch.Tensor]:
        """Copies of every created generator's state, keyed by (stream, device) (for recomputation)."""
        return {k: g.get_state() for k, g in self._gens.items()}

    def set_states(self, states: dict[tuple[str, str], torch.Tensor]) -> None:
        """Restore states saved by `get_states`. A generator created after the snapshot was at its
        seeded initial state then, so it is re-seeded."""
        for (name, dev), state in states.items():
            self.generator(name, dev).set_state(state)
        for key, gen in self._gens.items():
            if key not in states:
                gen.manual_seed(self.seeds[key[0]])

    @contextlib.contextmanager
    def fork(self, name: str = TP_STREAM, device="cpu"):
        """Run code that uses the global RNG of `device` on stream `name` instead, then restore."""
        device = torch.device(_device_key(device))
        gen = self.generator(name, device)
        if device.type == "cuda":
            saved = torch.cuda.get_rng_state(device)
            torch.cuda.set_rng_state(gen.get_state(), device)
        else:
            saved = torch.get_rng_state()
            torch.set_rng_state(gen.get_state())
        try:
            yield
        finally:
            if device.type == "cuda":
                gen.set_state(torch.cuda.get_rng_state(device))
                torch.cuda.set_rng_state(saved, device)
            else:
                gen.set_state(torch.get_rng_state())
                torch.set_rng_state(saved)


@dataclass(frozen=True)
class ShardInfo:
    """The local tensor is chunk `index` of `count` equal chunks of the logical tensor along `dim`."""

    dim: int
    index: int
    count: int

    def full_shape(self, local_shape) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] *= self.count
        return tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        return full.chunk(self.count, dim=self.dim)[self.index]


MaskFn = Callable[[str, torch.Size, "ShardInfo | None"], torch.Tensor]


class Dropout(nn.Module):
    """Dropout with keep-probability 1-p on a named stream of an `RNGStatesTracker`.

    Args:
        p: drop probability.
        tracker: the model's RNG tracker.
        stream: `TP_STREAM` or `REPLICATED_STREAM` (see the module docstring).
        site: layout-independent name of this dropout, for mask injection.
        shard: how the local activation relates to the logical one (None: it is the full tensor).
    """

    def __init__(self, p: float, tracker: RNGStatesTracker, stream: str, site: str,
                 shard: ShardInfo | None = None):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"{site}: dropout probability must be in [0, 1), got {p}")
        self.p, self.tracker, self.stream, self.site, self.shard = p, tracker, stream, site, shard
        self.mask_fn: MaskFn | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.mask_fn is not None:
            keep = self.mask_fn(self.site, x.shape, self.shard).to(device=x.device, dtype=torch.bool)
            if keep.shape != x.shape:
                raise ValueError(f"{self.site}: injected mask has shape {tuple(keep.shape)}, "
                                 f"expected {tuple(x.shape)}")
        else:
            gen = self.tracker.generator(self.stream, x.device)
            keep = torch.empty(x.shape, device=x.device, dtype=torch.float32)
            keep = keep.bernoulli_(1.0 - self.p, generator=gen).bool()
        return x.masked_fill(~keep, 0.0) * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, stream={self.stream}, site={self.site}"


def set_dropout_mask_fn(model_or_layers, mask_fn: MaskFn | None) -> int:
    """Install `mask_fn` (None removes it) on every `Dropout` in the module(s); returns how many."""
    mods = [model_or_layers] if isinstance(model_or_layers, nn.Module) else list(model_or_layers)
    n = 0
    for mod in mods:
        for m in mod.modules():
            if isinstance(m, Dropout):
                m.mask_fn = mask_fn
                n += 1
    return n


class LogicalMaskFn:
    """A mask function whose masks depend only on (seed, site, global micro-batch number at that site)
    and the logical full shape, never on the layout: it draws the full keep-mask with its own generator
    and returns this rank's slice. Calls are counted per site, so create one per run.

    Data parallelism: a step's global batch is split into dp_size · micro_batches micro-batches and dp
    rank r runs numbers r·micro_batches … (r+1)·micro_batches − 1 (the data sampler's split), so the
    n-th call at a site on rank r is global micro-batch (n // m)·m·dp + r·m + n % m, m = `micro_batches`
    (gradient accumulation steps). With the defaults (one rank) the call number is used as it is.
    Activation recomputation replays the call counts (`activation_checkpoint.region.RNGSnapshot`)."""

    def __init__(self, seed: int, p: float, dp_rank: int = 0, dp_size: int = 1, micro_batches: int = 1):
        self.seed, self.p = seed, p
        self.dp_rank, self.dp_size, self.micro_batches = dp_rank, dp_size, micro_batches
        self.calls: dict[str, int] = {}

    def __call__(self, site: str, shape, shard: ShardInfo | None) -> torch.Tensor:
        n = self.calls.get(site, 0)
        self.calls[site] = n + 1
        m = self.micro_batches
        n = (n // m) * m * self.dp_size + self.dp_rank * m + n % m  # the global micro-batch number
        full_shape = shard.full_shape(shape) if shard is not None else tuple(shape)
        gen = torch.Generator().manual_seed(stable_seed("mask", self.seed, site, n))
        keep = torch.rand(full_shape, generator=gen) >= self.p
        return shard.take(keep) if shard is not None else keep
