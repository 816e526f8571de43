"""The memory the communication options add (pure: no torch); `memory_plan.predict_memory` adds it.

* 1-bit Adam (``optimizer.type: onebit_adam``, zero 0): each flat bucket of P elements over n ranks has
  a `CompressedAverage` whose worker error holds P' fp32 (P padded to a multiple of 8n) and whose
  server error P'/n: 4·(P' + P'/n) bytes, in ``optimizer_states`` as
  `megazero.zero.optimizer.ZeroOptimizer.memory_breakdown` counts them (from the first step: they are
  allocated with the optimizer, before the warm-up ends).
* hpZ (``zero.hpz_partition_size`` = k): the transient ``hpz_secondary``, Σ over the stage-3 groups
  over dp (sharded, tied) of (P_b // k)·w for each bucket b: every rank keeps its 1/k of each bucket
  from the bucket's first gather of a step until the optimizer step (counted in ``params`` by
  `FlatGroup.memory` while held; between steps it is 0, so it is a transient here). Its whole sum is
  held at once at the end of the step's backward.
* qwZ (``zero.quantized_weights``) and qgZ (``zero.quantized_gradients``): the transient
  ``zeropp_int8``, the larger of the two, for the largest bucket (P elements, chunks of S = P/n elements
  padded to S' whole 256-element blocks, scales 4 bytes per block). qwZ, one gather
  (`zeropp.quantized_all_gather`): the int8 shard and gathered bucket with their scales,
  (n+1)·(S' + 4S'/256), then at its wait the n dequantized fp32 parts and their stack, 4n·S' + 4n·S
  (on top of the gathered bucket). Each further gather that prefetch keeps in
  flight holds another (n+1)·(S' + 4S'/256), not counted. qgZ, one reduce-scatter
  (`zeropp.quantized_reduce_scatter`, synchronous): the int8 chunks sent and received with their scales,
  2·n·(S' + 4S'/256), and the n dequantized fp32 chunks and their sum, 4n·S' + 4S' (the fp32 gradient
  bucket itself is in the planner's ``grad_buckets`` and ``zero_buffers``). Derived from the code's buffers, not compared with a
  measurement (gloo's own staging is not counted).
"""
from __future__ import annotations

BLOCK = 256
"""`megazero.zero.zeropp.BLOCK`: elements per int8 block with one fp32 scale."""


def onebit_sizes(numel: int, n: int, starts) -> tuple[int, int]:
    """(P' padded to a multiple of 8n, S scales) of `megazero.zero.onebit.CompressedAverage` over
    `numel` elements whose parameters begin at `starts` (one scale per piece, cut at every chunk)."""
    padded = -(-numel // (8 * n)) * 8 * n
    chunk = padded // n
    cuts = sorted(set(starts) | {j * chunk for j in range(n + 1)} | {numel})
    return padded, sum(1 for a, b in zip(cuts, cuts[1:]) if b > a)


def onebit_error_bytes(g) -> int:
    """4·(P' + P'/n) over the buckets of flat group `g` (a `memory_plan._Group` at stage 0)."""
    n, total = g.layout.dp_size, 0
    for bk in g.layout.buckets:
        padded, _ = onebit_sizes(bk.numel, n, ())
        total += 4 * (padded + padded // n)
    return total


def hpz_secondary_bytes(g, k: int, w: int) -> int:
    """Σ (P_b // k)·w over the buckets of a stage-3 group over dp."""
    return sum(bk.numel // k * w for bk in g.layout.buckets)


def _int8_peak(g, layout) -> int:
    n = g.layout.dp_size
    big = max((bk.numel for bk in g.layout.buckets), default=0)
    s = big // n
    sp = -(-s // BLOCK) * BLOCK
    packed = sp + 4 * sp // BLOCK  # one chunk's int8 and scales
    qwz = (n + 1) * packed + 4 * n * sp + 4 * n * s if layout.quantized_weights else 0
    qgz = 2 * n * packed + 4 * n * sp + 4 * sp if layout.quantized_gradients else 0
    return max(qwz, qgz)


def option_memory(groups, layout, w: int) -> tuple[int, dict[str, int]]:
    """(bytes to add to ``optimizer_states``, {transient name: bytes}) of one stage's flat `groups`."""
    states, secondary, int8 = 0, 0, 0
    for g in groups:
        if layout.onebit and g.stage == 0:
            states += onebit_error_bytes(g)
        if g.stage == 3 and g.name != "experts":  # ZeRO++ runs on the stage-3 groups over dp
            if layout.hpz > 1:
                secondary += hpz_secondary_bytes(g, layout.hpz, w)
            int8 = max(int8, _int8_peak(g, layout))
    transient = {}
    if layout.hpz > 1:
        transient["hpz_secondary"] = secondary
    if layout.quantized_weights or layout.quantized_gradients:
        transient["zeropp_int8"] = int8
    return states, transient
