"""Layout-invariant parameter initialization and the metadata every parameter carries.

The scheme. Every parameter has a *logical* full tensor, named by `logical_name` (for example
``"layers.5.mlp.fc1.weight"``, with the global layer index) and of shape `full_shape`, which does not
depend on the parallel layout. The logical tensor is cut into a fixed grid of tiles
(`TILE_2D` = 1024 x 1024 elements for matrices, `TILE_1D` = 2^20 for vectors); the grid depends
only on `full_shape`. Tile ``(i, j)`` is drawn from its own CPU generator seeded with
``stable_seed(seed, logical_name, i, j)``. A rank that holds a shard (a contiguous range of
`tp_dim`) generates only the tiles that overlap its shard, one at a time, and copies the overlap
into its shard. So:

* the same seed gives the same full model for every TP size and pipeline layout (a pipeline stage
  builds only its layers; a layer's values depend only on its global name);
* no rank ever holds more than its own shard plus one tile (4 MiB of fp32);
* construction on the ``meta`` device allocates nothing and draws nothing (for counting parameters).

Values are drawn on the CPU and copied to the parameter's device, so CPU and CUDA runs start from
bit-identical weights.

Metadata set on every parameter by `make_param` (read by pipeline, ZeRO, clipping and checkpoints):

* ``param.logical_name``: the name of the full logical parameter;
* ``param.full_shape``: its shape (without vocabulary padding);
* ``param.tp_dim``: the dim split across the TP group, or None when the parameter is replicated
  across TP (count it once when clipping; its gradient is identical on every TP rank, except
  with ``param.sequence_parallel`` where per-rank gradients are partial sums, see
  `megazero.tensor_parallel.params.sync_sequence_parallel_grads`);
* ``param.tp_size``, ``param.tp_rank``: the split, so shard ``tp_rank`` of ``tp_size`` equal
  chunks of the padded logical tensor along ``tp_dim``; rows past ``full_shape[tp_dim]`` are padding
  (zeros, used for the vocabulary);
* ``param.sequence_parallel``: its gradient must be summed over the TP group after backward;
* ``param.tied_name`` (optional): parameters with the same tied name are one logical parameter
  held on several ranks (the input and output embedding).
"""
from __future__ import annotations

import hashlib
import itertools
import math

import torch
from torch import nn

TILE_2D = (1024, 1024)
TILE_1D = (1 << 20,)


def stable_seed(*parts) -> int:
    """A 63-bit seed from `parts` that is the same in every process and Python version."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def tile_shape(full_shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(full_shape) == 1:
        return TILE_1D
    if len(full_shape) == 2:
        return TILE_2D
    raise ValueError(f"layout-invariant init supports 1-D and 2-D parameters, got shape {full_shape}")


def shard_range(full_size: int, padded_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, stop) of shard `tp_rank` along the split dim, in logical coordinates (stop may pass
    `full_size` when the split dim is padded)."""
    if padded_size % tp_size:
        raise ValueError(f"padded size {padded_size} is not divisible by tp_size {tp_size}")
    if padded_size < full_size:
        raise ValueError(f"padded size {padded_size} is smaller than the logical size {full_size}")
    local = padded_size // tp_size
    return tp_rank * local, (tp_rank + 1) * local


def tiles_for_shard(full_shape, tp_dim, start, stop):
    """Indices of the tiles of `full_shape` that overlap [start, stop) of `tp_dim` (all tiles of the
    other dims), in generation order. Pure: used by init and by its memory-bound test."""
    tile = tile_shape(tuple(full_shape))
    ranges = []
    for d, (n, t) in enumerate(zip(full_shape, tile)):
        if d == tp_dim:
            lo, hi = start, min(stop, n)
            ranges.append(range(lo // t, (hi + t - 1) // t) if hi > lo else range(0))
        else:
            ranges.append(range((n + t - 1) // t))
    return list(itertools.product(*ranges))


@torch.no_grad()
def init_normal_shard_(shard: torch.Tensor, logical_name: str, full_shape, tp_dim, tp_rank: int,
                       tp_size: int, seed: int, std: float) -> torch.Tensor:
    """Fill `shard` with its slice of the logical N(0, std²) tensor named `logical_name` (see the module
    docstring); padding rows beyond `full_shape[tp_dim]` become zeros. No-op on the meta device."""
    if shard.device.type == "meta":
        return shard
    full_shape = tuple(full_shape)
    tile = tile_shape(full_shape)
    start = stop = 0  # the shard's range along tp_dim (unused when replicated)
    if tp_dim is not None:
        padded = shard.shape[tp_dim] * tp_size
        start, stop = shard_range(full_shape[tp_dim], padded, tp_rank, tp_size)
    shard.zero_()
    for idx in tiles_for_shard(full_shape, tp_dim, start, stop):
        lo = [i * t for i, t in zip(idx, tile)]
        hi = [min(n, l + t) for n, l, t in zip(full_shape, lo, tile)]
        gen = torch.Generator(device="cpu").manual_seed(stable_seed(seed, logical_name, *idx))
        block = torch.randn([h - l for l, h in zip(lo, hi)], generator=gen, dtype=torch.float32)
        block.mul_(std)
        src, dst = [], []
        for d in range(len(full_shape)):
            if d == tp_dim:  # overlap of [lo, hi) with this rank's [start, stop)
                a, b = max(lo[d], start), min(hi[d], stop)
                src.append(slice(a - lo[d], b - lo[d]))
                dst.append(slice(a - start, b - start))
            else:
                src.append(slice(None))
                dst.append(slice(lo[d], hi[d]))
        shard[tuple(dst)].copy_(block[tuple(src)])
    return shard


def make_param(local_shape, *, logical_name: str, full_shape, tp_dim, tp_rank: int, tp_size: int,
               init: str, seed: int, std: float = 0.02, device=None,
               dtype: torch.dtype = torch.float32) -> nn.Parameter:
    """A parameter holding this rank's shard, initialized layout-invariantly, with its metadata.

    init: ``"normal"`` (N(0, std²) by tiles), ``"zeros"`` or ``"ones"``; padding is always zero.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    full_shape = tuple(int(n) for n in full_shape)
    data = torch.empty(tuple(local_shape), device=device, dtype=dtype)
    if device.type != "meta":
        if init == "normal":
            buf = data if dtype == torch.float32 else torch.empty(data.shape, device=device)
            init_normal_shard_(buf, logical_name, full_shape, tp_dim, tp_rank, tp_size, seed, std)
            if buf is not data:
                data.copy_(buf)
        elif init in ("zeros", "ones"):
            data.zero_()
            if init == "ones":
                valid = data if tp_dim is None else data.narrow(
                    tp_dim, 0, max(0, min(data.shape[tp_dim],
                                          full_shape[tp_dim] - tp_rank * data.shape[tp_dim])))
                valid.fill_(1.0)
        else:
            raise ValueError(f"{logical_name}: unknown init {init!r}; valid: normal, zeros, ones")
    p = nn.Parameter(data)
    p.logical_name = logical_name
    p.full_shape = full_shape
    p.tp_dim = tp_dim
    p.tp_rank = tp_rank if tp_dim is not None else 0
    p.tp_size = tp_size if tp_dim is not None else 1
    p.sequence_parallel = False
    return p


def local_size(full: int, tp_size: int, what: str) -> int:
    """`full` / `tp_size`, or an error naming `what` when it does not divide."""
    if full % tp_size:
        raise ValueError(f"{what}={full} is not divisible by the tensor-parallel size {tp_size}")
    return full // tp_size


def padded_size(full: int, tp_size: int, align: int = 1) -> int:
    """The smallest multiple of tp_size·align that is >= full (vocabulary padding)."""
    if align < 1:
        raise ValueError(f"vocab alignment must be >= 1, got {align}")
    m = tp_size * align
    return int(math.ceil(full / m) * m)
