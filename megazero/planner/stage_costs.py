"""Per pipeline stage: parameters, data-parallel traffic, the optimizer step, transfers, and the cost of
every instruction of its program (`StageCosts`, the simulator's cost function). Pure: no torch; the
model is stated in speed.py's docstring."""
from __future__ import annotations

import math

from megazero.core.instructions import (
    P2P, Backward, BackwardInput, BackwardWeight, Forward, LoadMicroBatch, OptimizerStep, ReduceGrads,
    virtual_stage,
)
from megazero.core.partition import segment_sizes
from megazero.core.schedules import get_schedule, splits_backward
from megazero.core.simulate import Costs
from megazero.planner.block_cost import block_cost, embedding_head_cost
from megazero.planner.layout import PlanError
from megazero.planner.machine import Machine, add_parts, scale_parts
from megazero.planner.stages import blocks_per_chunk, chunk_shares, pipeline_layers

# -- parameters per stage --------------------------------------------------------------------------------

def _stage_params(spec, layout, block_params: float, facts, blocks: list[int]) -> list[tuple[float, float, int]]:
    """Per pipeline rank: (parameters on one TP rank but the routed experts, of which tied embedding/head
    copies, blocks). From `facts` (`ModelFacts`) when given, else counted from the spec: `blocks[s]` times
    the block's GEMM weights, biases and norms, the (padded, vocabulary-parallel) embedding and learned
    positions on the first stage, the final norm and the head (a tied copy when pp > 1) on the last."""
    if facts is not None:
        if len(facts.stages) != layout.pp:
            raise PlanError(f"facts describe {len(facts.stages)} pipeline stages, the layout has pp={layout.pp}")
        return [(float(st.params - st.expert_params), float(st.tied_params), st.layers) for st in facts.stages]
    t, h = layout.tp, spec.hidden
    norm = (2 if spec.norm == "layernorm" else 1) * h
    bias = 0
    if spec.bias:  # column-parallel biases are split, the row-parallel ones (out, fc2) replicated
        mlp_in = spec.ffn * (2 if spec.activation == "swiglu" else 1) if spec.moe is None else 0
        bias = ((spec.heads + 2 * spec.num_kv_heads) * spec.head_dim + mlp_in) // t + (1 if spec.moe else 2) * h
    per_layer = block_params + bias + 2 * norm
    vocab = spec.padded_vocab(t) // t * h
    stages = []
    for s, layers in enumerate(blocks):
        params, tied = layers * per_layer, 0.0
        if s == 0:
            params += vocab + (spec.seq_len * h if spec.position == "learned" else 0)
            tied += vocab if spec.tie_embeddings and layout.pp > 1 else 0
        if s == layout.pp - 1:
            params += norm
            if not spec.tie_embeddings or layout.pp > 1:
                params += vocab
                tied += vocab if spec.tie_embeddings else 0
        stages.append((params, tied, layers))
    return stages


# -- data parallel and the optimizer -----------------------------------------------------------------------

def _hidden(total: float, window: float, last_fraction: float) -> float:
    """Exposed part of `total` seconds of communication launched during `window` seconds of compute:
    at least its last bucket (`last_fraction` of it) waits for the end."""
    return max(total * min(1.0, last_fraction), total - window)


ONEBIT_PASS_BYTES = 140
"""Bytes per element of a bucket that 1-bit Adam's compressed average (``zero/onebit.py``) reads and writes
in memory-bound passes, counted from its unfused PyTorch ops: the worker's compression of momentum plus
error (padding copy, sum, norms, signs, scales spread per element, error update: ~60), packing, the
server's unpacking and mean of the n chunks (~35), and the final unpacking and copy (~40)."""

QUANT_PASS_BYTES = 30
"""Bytes per element that int8 block quantization (``zero/zeropp.py:quantize``: abs-max, divide, round,
clamp, cast) or dequantization (cast, scale, stack, copy into the bucket) reads and writes."""

INT8 = 1 + 4 / 256
"""Bytes per element of an int8 collective of ZeRO++ (one fp32 scale per 256-element block)."""


def _shards(layout, mc: Machine, dense: float, experts: float) -> list[tuple[float, int, int, bool]]:
    """(parameters, ranks, stride, ZeRO++ applies) of each data-parallel group a stage's gradients are
    reduced over: the dense ones over dp x cp (every replica: the dp ranks and their cp ranks, dp·cp ranks tp
    apart), an MoE model's routed experts over the (dp / ep) x cp ranks holding the same experts (ranks ep·tp
    apart on average: runs of cp ranks tp apart, ep·cp·tp between the runs; ZeRO++ leaves them alone, as the
    runtime does)."""
    out = [(dense, layout.dp_cp, layout.tp, True)]
    if experts:
        out.append((experts, layout.edp_cp, layout.ep * layout.tp, False))
    return out


def _stage3_gathers(layout, mc: Machine, psi: float, n: int, stride: int, zpp: bool,
                    units: int = 1) -> tuple[float, float]:
    """(first, later) seconds of one stage-3 gather of `psi` parameters: qwZ gathers int8 blocks (INT8 bytes
    per element) and quantizes the shard and dequantizes the bucket; with hpZ the later gathers of a step
    go over the hpz group (k ranks `stride` apart, on NVLink when k·stride fits a node), in the working
    dtype. One all-gather per unit (`units`: the chunk's layers), each paying the collective's latency."""
    first = later = mc.dp_collective("all_gather", psi * mc.act, n, stride, units)
    if zpp and layout.quantized_weights:
        first = later = (mc.dp_collective("all_gather", psi * INT8, n, stride, units)
                         + mc.mem(QUANT_PASS_BYTES * psi * (1 + 1 / n), kernels=8))
    if zpp and layout.hpz > 1:
        later = mc.ring("all_gather", psi * mc.act, layout.hpz, mc.link(stride, layout.hpz), stride, units)
    return first, later


def _reduce_scatter(layout, mc: Machine, impl, psi: float, n: int, stride: int, zpp: bool, units: int = 1) -> float:
    """The reduce-scatters of `psi` gradients, one per bucket (`reduce_bucket_size`; at ZeRO-3 at least one per
    unit: buckets end at unit boundaries); qgZ (stage 3): an all-to-all of INT8 bytes per element with the
    quantization of the bucket and the dequantization and sum of the chunks received."""
    if zpp and layout.zero == 3 and layout.quantized_gradients:
        return mc.all_to_all((n - 1) / n * psi * INT8, n, stride) + mc.mem(2 * QUANT_PASS_BYTES * psi, kernels=8)
    buckets = max(math.ceil(psi / layout.reduce_bucket_size), units if layout.zero == 3 else 1)
    return mc.dp_collective("reduce_scatter", psi * impl.grad_bytes, n, stride, buckets)


def _onebit_average(layout, mc: Machine, psi: float, n: int, stride: int) -> float:
    """1-bit Adam's compressed average of `psi` momentum elements over n ranks: the all-to-all and the
    all-gather of packed signs ((n−1)/n·psi/8 bytes each), two small collectives of the scales (their
    latency), and ONEBIT_PASS_BYTES per element of memory-bound passes."""
    if n <= 1:
        return 0.0
    buckets = max(1.0, psi / layout.reduce_bucket_size)
    return (mc.all_to_all((n - 1) / n * psi / 8, n, stride) + mc.dp_collective("all_gather", psi / 8, n, stride)
            + 2 * buckets * mc.eff.collective_us * 1e-6 + mc.mem(ONEBIT_PASS_BYTES * psi, kernels=int(30 * buckets)))


def _dp_per_microbatch(layout, mc: Machine, impl, shards, f_time: float, b_time: float, units: int = 1):
    """Extra (forward, backward) seconds per micro-batch and chunk: ZeRO-2's reduce-scatter, ZeRO-3's
    gathers and reduce-scatter, over each group of `shards` ((parameters of the chunk, ranks, stride,
    ZeRO++)), hidden behind the chunk's compute when overlap_comm (never in two levels: synchronous).
    hpZ: of the m micro-batches' forward gathers only the first goes over dp (averaged over them).
    `units`: the chunk's layers, ZeRO-3's gathering units: one all-gather each per forward and backward."""
    z, m = layout.zero, layout.num_microbatches
    psi_chunk = sum(sh[0] for sh in shards)
    if z < 2 or all(sh[1] == 1 for sh in shards):
        return 0.0, 0.0
    rs = sum(_reduce_scatter(layout, mc, impl, *sh, units) for sh in shards)
    overlaps = layout.overlaps and not any(mc.two_level(st, n) for _, n, st, _ in shards)
    reduce_frac = layout.reduce_bucket_size / max(psi_chunk, 1.0)
    if z == 2:
        return 0.0, _hidden(rs, b_time, reduce_frac) if overlaps else rs
    ag_f = ag_b = 0.0
    for sh in shards:
        first, later = _stage3_gathers(layout, mc, *sh, units)
        ag_f += (first + (m - 1) * later) / m
        ag_b += later
    if layout.offload_param:  # the shard comes from host memory first
        host = sum(psi / n for psi, n, _, _ in shards) * mc.act / (mc.eff.pcie_gbs * 1e9)
        ag_f, ag_b = ag_f + host, ag_b + host
    if not overlaps:
        return ag_f, ag_b + rs
    pre = layout.prefetch_bucket_size / max(psi_chunk, 1.0)
    return _hidden(ag_f, f_time, pre), _hidden(ag_b + rs, b_time, pre)


def _reduce_and_step(layout, mc: Machine, impl, shards, tied: float, last_backward: float):
    """({category: s} of ReduceGrads, of OptimizerStep) on one stage whose gradients are reduced over
    the groups of `shards` ((parameters, ranks, stride, ZeRO++)). 1-bit Adam (zero 0, past its warm-up):
    no gradient reduction; the step averages the momentum in 1 bit (`_onebit_average`)."""
    dp, z = layout.dp_cp, layout.zero  # the replicas: dp x cp
    psi = sum(sh[0] for sh in shards)
    reduce, onebit = 0.0, 0.0
    if z <= 1 and layout.onebit:
        onebit = sum(_onebit_average(layout, mc, p, n, st) for p, n, st, _ in shards)
    elif z <= 1:
        kind = "all_reduce" if z == 0 else "reduce_scatter"
        total = sum(mc.dp_collective(kind, p * impl.grad_bytes, n, st, math.ceil(p / layout.reduce_bucket_size))
                    for p, n, st, _ in shards)
        overlaps = layout.overlaps and not any(mc.two_level(st, n) for _, n, st, _ in shards)
        reduce = _hidden(total, last_backward, layout.reduce_bucket_size / max(psi, 1.0)) if overlaps else total
    if tied and layout.pp > 1:  # embedding and head copies (their dp shards at stages 1-3), first and last
        tied_bytes = tied * impl.grad_bytes / (dp if z >= 1 else 1)  # stage: ranks (pp-1)·dp·cp·tp apart
        reduce += mc.ring("all_reduce", tied_bytes, 2, mc.link((layout.pp - 1) * dp * layout.tp, 2))
    shard = sum(p / n for p, n, _, _ in shards) if z >= 1 else psi
    if layout.offload_optimizer:
        # the host's Adam is compute (`Machine.in_step`); the PCIe copies are transfers
        adam = shard * 28 / (mc.eff.host_gbs * 1e9) * mc.in_step + shard * 6 / (mc.eff.pcie_gbs * 1e9)
    else:
        adam = mc.mem(shard * (34 if mc.act == 2 else 32), kernels=4)
    gather = sum(mc.dp_collective("all_gather", p * mc.act, n, st, math.ceil(p / layout.allgather_bucket_size))
                 for p, n, st, _ in shards) if z in (1, 2) else 0.0
    return {"dp_comm": reduce}, {"optimizer": adam, "dp_comm": gather + onebit}


# -- activation checkpoints ----------------------------------------------------------------------------------

def _checkpoint_io(spec, layout, mc: Machine, blocks: int) -> tuple[float, float, float]:
    """(forward, backward, backward's collective) seconds one micro-batch's full-policy checkpoints of a chunk of
    `blocks` blocks add beside the recompute itself: per segment the kept input's copy (partitioned: this
    rank's 1/t; to host over PCIe with cpu_checkpointing) and in backward its way back (the host-to-device
    copy of a CPU one; the all-gather over the TP group of a partitioned one, the third)."""
    if layout.recompute != "full" or not blocks:
        return 0.0, 0.0, 0.0
    segments = len(segment_sizes(blocks, layout.every_k_layers, layout.number_checkpoints))
    t = layout.tp
    full = layout.micro_batch * spec.seq_len // layout.cp * spec.hidden * mc.act / (t if layout.sequence_parallel else 1)
    kept = full / t if layout.partition_activations else full
    fwd = bwd = 0.0
    if layout.partition_activations or layout.contiguous_checkpoints:
        fwd += mc.mem(2 * kept)  # the copy into its own (or the buffer's) storage
    if layout.cpu_checkpointing:
        pcie = kept / (mc.eff.pcie_gbs * 1e9)
        fwd, bwd = fwd + pcie, bwd + pcie
    gather = mc.ring("all_gather", kept * t, t, mc.link(1, t)) if layout.partition_activations else 0.0
    return segments * fwd, segments * bwd, segments * gather


# -- the pipeline ----------------------------------------------------------------------------------------

def _p2p_time(spec, layout, mc: Machine, impl, a: int, b: int) -> float:
    """One activation (or its grad) between pipeline ranks a and b: NVLink when all the ranks of
    both stages share a node, else the inter-node link of each GPU. With context parallelism each rank
    sends its s/cp tokens; a stage is dp·cp·tp ranks."""
    tokens, t, g = layout.micro_batch * spec.seq_len // layout.cp, layout.tp, mc.node
    nbytes = tokens * spec.hidden * mc.act / (t if layout.sequence_parallel else 1)
    ranks = layout.dp * layout.cp * t
    lo, hi = min(a, b), max(a, b)
    same_node = (lo * ranks) // g == ((hi + 1) * ranks - 1) // g  # nodes hold consecutive ranks
    bw = mc.nvlink if same_node else mc.internode
    if impl.p2p_scatter_gather and not layout.sequence_parallel and t > 1 and not same_node:
        return nbytes / t / bw + mc.eff.collective_us * 1e-6 + mc.ring("all_gather", nbytes, t, mc.link(1, t))
    return nbytes / bw + mc.eff.collective_us * 1e-6


class StageCosts:
    """Parts dicts of every compute instruction kind per (stage, chunk); the simulator's cost function."""

    @classmethod
    def of(cls, spec, layout, hardware, facts, efficiency, impl) -> "StageCosts":
        """The costs of `layout` (checked against `spec`) on `hardware`; backward split for ZB-H1."""
        layout.check(spec)
        split = (splits_backward(get_schedule(layout.schedule, layout.pp, layout.num_microbatches, layout.chunks))
                 if layout.custom_schedule else layout.schedule == "zb-h1")
        return cls(spec, layout, Machine(hardware, efficiency, layout), impl, facts, split)

    def __init__(self, spec, layout, mc: Machine, impl, facts, split: bool):
        self.mc, self.split = mc, split
        p, v = layout.pp, layout.chunks
        blk = block_cost(spec, layout, mc, impl)
        emb_f, emb_b, head_f, head_b, head_w = embedding_head_cost(spec, layout, mc)
        blocks = blocks_per_chunk(spec, layout)  # [stage][chunk], the trainer's partition
        shares = chunk_shares(spec, layout)
        layer_kinds_of = pipeline_layers(spec, layout)  # [stage][chunk] -> its layers (ZeRO-3 units)
        stages = _stage_params(spec, layout, blk.params, facts, [sum(b) for b in blocks])
        last = p * v - 1
        self.parts: dict = {}
        self.p2p = {}
        for s, (psi, tied, layers) in enumerate(stages):
            shards = _shards(layout, mc, psi, blk.expert_params * layers)
            for c in range(v):
                per_chunk = blocks[s][c]
                vs = virtual_stage(s, c, p)
                f = add_parts(scale_parts(blk.fwd, per_chunk), emb_f if vs == 0 else {}, head_f if vs == last else {})
                ckpt_f, ckpt_b, ckpt_gather = _checkpoint_io(spec, layout, mc, per_chunk)
                f = add_parts(f, {"recompute": ckpt_f}) if ckpt_f else f
                b = add_parts(scale_parts(blk.bwd, per_chunk), {"recompute": blk.recompute * per_chunk + ckpt_b},
                         {"tp_comm": (blk.tp_bwd if split else blk.tp_bwd_overlapped) * per_chunk + ckpt_gather},
                         scale_parts(blk.recompute_comm, per_chunk),
                         emb_b if vs == 0 else {}, head_b if vs == last else {})
                w = add_parts(scale_parts(blk.wgrad, per_chunk), head_w if vs == last else {})
                chunk_shards = [(x * share, *rest) for share, (x, *rest) in zip(shares[s][c], shards)]
                units = len(layer_kinds_of[s][c])
                dp_f, dp_b = _dp_per_microbatch(layout, mc, impl, chunk_shards, sum(f.values()),
                                                sum(b.values()) + sum(w.values()), units)
                f = add_parts(f, {"dp_comm": dp_f})
                if split:
                    w = add_parts(w, {"dp_comm": dp_b})
                else:
                    b, w = add_parts(b, w, {"dp_comm": dp_b}), {}
                self.parts[(s, "F", c)], self.parts[(s, "B", c)], self.parts[(s, "W", c)] = f, b, w
            last_backward = sum(sum(self.parts[(s, k, c)].values()) for c in range(v) for k in "BW")
            self.parts[(s, "R", 0)], self.parts[(s, "O", 0)] = _reduce_and_step(layout, mc, impl, shards, tied,
                                                                                  last_backward)
            for peer in {(s - 1) % p, (s + 1) % p} - {s}:
                self.p2p[(s, peer)] = _p2p_time(spec, layout, mc, impl, s, peer)

    def key(self, stage: int, ins):
        if isinstance(ins, Forward):
            return (stage, "F", ins.chunk)
        if isinstance(ins, (Backward, BackwardInput)):
            return (stage, "B", ins.chunk)
        if isinstance(ins, BackwardWeight):
            return (stage, "W", ins.chunk)
        if isinstance(ins, ReduceGrads):
            return (stage, "R", 0)
        if isinstance(ins, OptimizerStep):
            return (stage, "O", 0)
        return None

    def parts_of(self, stage: int, ins) -> dict:
        """Seconds per breakdown category of compute or step instruction `ins` on `stage`."""
        return self.parts[self.key(stage, ins)]

    def __call__(self, stage: int, ins) -> float:
        if isinstance(ins, P2P):
            return self.p2p[(stage, ins.peer)]
        if isinstance(ins, LoadMicroBatch):
            return 0.0
        return sum(self.parts_of(stage, ins).values())

    def per_stage(self, stage: int, v: int) -> tuple[float, float, float]:
        return tuple(sum(sum(self.parts[(stage, k, c)].values()) for c in range(v)) for k in "FBW")


def tuning(costs: StageCosts, layout) -> Costs:
    """Uniform unit costs (F = 1) that the blocking transfer order is built for (`build_programs`),
    rounded to eighths so that similar layouts share the cached programs."""
    f, b, w = costs.per_stage(layout.pp // 2, layout.chunks)

    def eighths(x: float) -> float:
        return max(1, round(8 * x / f)) / 8

    return Costs(forward=1.0, backward_input=eighths(b), backward_weight=eighths(w) if w else 0.0)
