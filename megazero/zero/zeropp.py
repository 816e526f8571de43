"""ZeRO++ (Wang et al. 2023; DeepSpeed's zero_quantized_weights, zero_hpz_partition_size,
zero_quantized_gradients): three ways for ZeRO-3 to move fewer bytes, each a config key.

* qwZ, ``zero.quantized_weights``: a bucket's parameters are all-gathered as int8, in blocks of
  `BLOCK` elements with one fp32 scale each (symmetric: scale = max|x| / 127, x ≈ q · scale), and
  dequantized into the working dtype: (n−1)·(S + 4·S/BLOCK) bytes per gather of S-element shards
  instead of (n−1)·S·w. Forward and backward then compute with weights off by at most scale/2 =
  max|block| / 254 per element; the fp32 master and the update are exact. Transient memory: the
  int8 shard and the gathered int8 bucket while a gather is in flight (S and n·S bytes, plus scales).
* hpZ, ``zero.hpz_partition_size`` = k: after a bucket's first gather of a step, each rank keeps
  1/k of it (its part for its rank in `hpz_group`, k consecutive data-parallel ranks, one node when
  k = ranks per node); the bucket's later gathers in that step (backward, the next micro-batches)
  all-gather those parts over `hpz_group` only, so they never leave the node. Exact: the same values.
  Memory: P·w/k per bucket of P elements from its first gather until the optimizer step (counted in
  ``params`` by `FlatGroup.memory`).
* qgZ, ``zero.quantized_gradients``: a bucket's gradient reduce-scatter quantizes each rank's fp32
  gradient to int8 blocks, sends chunk j to rank j by all-to-all, and sums the dequantized chunks:
  (n−1)/n·(P + 4·P/BLOCK) bytes instead of (n−1)/n·4P; each rank's contribution is off by at most
  max|block| / 254 per element, so the reduced gradient by at most the sum over ranks (and the
  average by their mean) of that. Transient memory: the int8 bucket and the int8 chunks received
  (P and P bytes, plus scales).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megazero.runtime import comm
from megazero.runtime.comm import GroupHandle, Pending

BLOCK = 256
"""Elements per quantization block (one fp32 scale each: 4/BLOCK bytes of overhead per element)."""


@dataclass(frozen=True)
class ZeroPlusPlus:
    """Which ZeRO++ options a stage-3 flat group uses: `quantized_weights` (qwZ),
    `quantized_gradients` (qgZ) and `hpz_group` (hpZ's secondary partition group, None: off)."""

    quantized_weights: bool = False
    quantized_gradients: bool = False
    hpz_group: GroupHandle | None = None


def quantize(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 (numel padded to a multiple of `block`), fp32 scales (one per block)) of flat `x`."""
    x = x.reshape(-1).float()
    pad = (-x.numel()) % block
    blocks = torch.cat([x, x.new_zeros(pad)]).view(-1, block) if pad else x.view(-1, block)  # (nb, block)
    scales = blocks.abs().amax(1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block stays zero
    q = torch.round(blocks / scales.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q.view(-1), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, numel: int, block: int = BLOCK) -> torch.Tensor:
    """fp32 (numel,) of `quantize`'s output."""
    return (q.view(-1, block).float() * scales.unsqueeze(1)).view(-1)[:numel]


def quantized_all_gather(output: torch.Tensor, shard: torch.Tensor, group: GroupHandle, async_op: bool = False):
    """qwZ: every rank's `shard` (S elements) into `output` (n·S, rank order) through int8 blocks over
    `group`; returns a handle (`Pending`) whose wait dequantizes, or None when done (not async)."""
    n, s = group.size, shard.numel()
    q, scales = quantize(shard)
    all_q = q.new_empty(n * q.numel())
    all_scales = scales.new_empty(n * scales.numel())
    works = [comm.all_gather(all_q, q, group, async_op=async_op),
             comm.all_gather(all_scales, scales, group, async_op=async_op)]

    def finish():
        parts = [dequantize(qq, sc, s) for qq, sc in zip(all_q.view(n, -1), all_scales.view(n, -1))]
        output.view(n, s).copy_(torch.stack(parts))

    if not async_op:
        finish()
        return None
    return Pending(works, finish)


def quantized_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: GroupHandle) -> None:
    """qgZ: the sum over `group` of every rank's `input` (n·S fp32), shard r into rank r's `output` (S),
    each rank's chunks sent as int8 blocks by all-to-all."""
    n, s = group.size, output.numel()
    pad = (-s) % BLOCK
    chunks = input.view(n, s)
    if pad:
        chunks = torch.cat([chunks, chunks.new_zeros(n, pad)], dim=1)  # (n, S padded): whole blocks per chunk
    q, scales = quantize(chunks)  # blocks never straddle two chunks
    got_q, got_scales = torch.empty_like(q), torch.empty_like(scales)
    comm.all_to_all_single(got_q, q, group)  # chunk j to rank j
    comm.all_to_all_single(got_scales, scales, group)
    total = dequantize(got_q, got_scales, n * (s + pad)).view(n, s + pad).sum(0)
    output.view(-1).copy_(total[:s])


__all__ = ["BLOCK", "ZeroPlusPlus", "dequantize", "quantize", "quantized_all_gather",
           "quantized_reduce_scatter"]
