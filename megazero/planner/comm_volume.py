"""Bytes each rank moves over its data-parallel and context-parallel groups in one step, and the part that
leaves its node (pure: no torch), counted as megazero's ``runtime/comm.py`` counts them in `CommStats`, from
the same flat groups and buckets the memory plan builds (`memory_plan.flat_groups`).

Per bucket of P padded elements over a group of n ranks (dp, axis ``dp``; with context parallelism the dp x cp
ranks holding the same parameters, axis ``dp_cp``; the routed experts' dp / ep), fp32 gradients and w-byte
parameters, m micro-batches:

* zero 0: one all-reduce of 4P (2(n−1)/n·4P bytes); with 1-bit Adam past its warm-up instead the
  compressed average of ``zero/onebit.py``: P padded to P' (a multiple of 8n), S scales (one per
  parameter piece, cut at each rank's chunk): an all-to-all of packed signs ((n−1)/n·P'/8), an all-gather
  of the worker scales ((n−1)·4S), an all-gather of the server's packed signs ((n−1)/n·P'/8) and an
  all-reduce of the server scales (2(n−1)/n·4S).
* zero 1: a reduce-scatter of 4P, then the all-gather of the updated w·P; zero 2: m reduce-scatters
  and the all-gather.
* zero 3 (sharded groups): per micro-batch 2 gathers of each bucket (forward, backward) of w·P, and
  a reduce-scatter of 4P. qwZ: each dp gather is two all-gathers, int8 shards of S' = P/n padded to
  whole 256-element blocks and their fp32 scales: (n−1)·(S' + 4S'/256). hpZ (k): only the step's
  first gather of a bucket goes over dp; the other 2m − 1 all-gather the kept parts over the hpz
  group of k consecutive dp ranks, (k−1)/k·w·P (never quantized). qgZ: the reduce-scatter becomes two
  all-to-alls, int8 chunks and their scales: (n−1)·(S' + 4S'/256).
* the loss's fp64 all-reduce over dp (dp x cp; one element); tied embedding / head gradients (pp > 1): an
  all-reduce of their owned slices over the embedding group (first and last stage; in
  ``internode`` only, it is not a dp axis).

Hierarchical (``comm.hierarchical``), for a group spread evenly over N > 1 nodes with k > 1 members
each: an all-reduce of T elements (padded to T', a multiple of k) is a reduce-scatter and an
all-gather inside the node ((k−1)/k·T' each) and an all-reduce of T'/k between nodes (2(N−1)/N·T'/k);
a reduce-scatter or all-gather of n·S elements is (k−1)·N·S inside and (N−1)·S between the nodes.
All-to-alls stay flat. What leaves a node: the inter-node level, all of it; in a flat ring a rank's
whole figure when the next rank of the ring is on another node (N of the n ranks), in an all-to-all
its rows for the other nodes' ranks. Figures are means over the ranks of a stage (the flat ring's
crossing falls on N ranks of each group); a step's figure, the mean over every GPU.

Context parallelism (axis ``cp``, the cp ranks of one sequence, tp apart), per block of the stage and
micro-batch, `cp_cost.transfers`: the ring's key/value blocks (sends and receives, ``send`` / ``recv``: a rank's
crossing when its next, or previous, cp rank is on another node) or Ulysses' all-to-alls, and an MoE layer's
load-balancing sums (all-reduces); the recompute sends the forward's again (selective: the core's; full: the
block's). `Volume.internode_bytes` leaves them out (data parallel and tied embeddings), `Volume.cp_internode_bytes`
is their crossing.

Not counted: TP collectives, pipeline transfers, MoE all-to-alls, the scalars of the global norm over
every rank. A stage-3 bucket is gathered twice per micro-batch (``zero/stage3.py``: before its unit's
forward and backward), the bucket of a tied embedding at pp = 1 three times (the embedding's and the
head's forward, and once for both backwards: it stays gathered until its gradients are complete).
"""
from __future__ import annotations

from collections import Counter

from dataclasses import dataclass

from megazero.planner.comm_memory import BLOCK, onebit_sizes
from megazero.planner.cp_cost import transfers
from megazero.planner.memory_plan import flat_groups
from megazero.planner.stages import pipeline_layers

def _ceil(a: int, b: int) -> int:
    return -(-a // b) * b


def _node_split(ranks: list[int], rpn: int):
    """(k members per node, N nodes) of a group spread evenly over its nodes, else None
    (`megazero.runtime.hierarchical.node_split`)."""
    per: dict[int, int] = {}
    for r in ranks:
        per[r // rpn] = per.get(r // rpn, 0) + 1
    sizes = set(per.values())
    return (sizes.pop(), len(per)) if len(sizes) == 1 else None


class GroupFamily:
    """The groups of one axis on one pipeline stage (lists of global ranks, one per rank of the stage),
    and what one collective over them moves per rank, on average over their members."""

    def __init__(self, axis: str, groups: list[list[int]], rpn: int, hierarchical: bool):
        self.axis, self.n = axis, len(groups[0])
        members = sum(len(g) for g in groups)
        self.ring_cross = sum(1 for g in groups for i, r in enumerate(g)
                              if g[(i + 1) % len(g)] // rpn != r // rpn) / members
        away = 0  # members on other nodes, summed over every member (a node's count once per group)
        for g in groups:
            per_node = Counter(r // rpn for r in g)
            away += sum(c * (len(g) - c) for c in per_node.values())
        self.a2a_away = away / members / self.n
        splits = [_node_split(g, rpn) for g in groups]
        self.levels = None  # (k, N) when the two-level form applies (ParallelContext._build_data_parallel)
        if hierarchical and self.n > 1 and all(s is not None and s[0] > 1 and s[1] > 1 for s in splits):
            self.levels = splits[0]

    def op(self, kind: str, numel: float, elem: int, out: "Volume", times: float = 1.0) -> None:
        """Add one `kind` (all_reduce of `numel`; reduce_scatter / all_gather / all_to_all of `numel` in
        the whole tensor) of `elem`-byte elements, `times` over, to `out`."""
        n = self.n
        if n == 1 or numel <= 0 or times == 0:
            return
        if kind in ("send", "recv"):  # around the ring: to the next member, from the previous one
            moved = times * numel * elem
            out.add(self.axis, kind, moved, moved * self.ring_cross)
            return
        if kind == "all_to_all":
            out.add(self.axis, kind, times * (n - 1) / n * numel * elem, times * self.a2a_away * numel * elem)
            return
        if self.levels is not None:
            k, nodes = self.levels
            if kind == "all_reduce":
                t = _ceil(int(numel), k)
                out.add(self.axis + ".intra", "reduce_scatter", times * (k - 1) * t / k * elem, 0.0)
                out.add(self.axis + ".intra", "all_gather", times * (k - 1) * t / k * elem, 0.0)
                inter = times * 2 * (nodes - 1) / nodes * t / k * elem
            else:
                s = numel / n
                out.add(self.axis + ".intra", kind, times * (k - 1) * nodes * s * elem, 0.0)
                inter = times * (nodes - 1) * s * elem
            out.add(self.axis + ".inter", kind, inter, inter)
            return
        moved = (2 if kind == "all_reduce" else 1) * (n - 1) / n * numel * elem * times
        out.add(self.axis, kind, moved, moved * self.ring_cross)


@dataclass
class Volume:
    """Mean bytes per rank by ``"axis/op"`` (`moved`) and of them what left the node (`crossed`)."""

    moved: dict
    crossed: dict

    def add(self, axis: str, op: str, moved: float, crossed: float) -> None:
        key = f"{axis}/{op}"
        self.moved[key] = self.moved.get(key, 0.0) + moved
        self.crossed[key] = self.crossed.get(key, 0.0) + crossed

    @property
    def dp_bytes(self) -> float:
        """Bytes over the data-parallel axes (dp or dp_cp, edp or edp_cp, their levels, hpz)."""
        return sum(v for k, v in self.moved.items() if k.split("/")[0].split(".")[0] in DP_AXES)

    @property
    def internode_bytes(self) -> float:
        """Bytes that left the node over the data-parallel axes and the tied embeddings' group."""
        return sum(v for k, v in self.crossed.items() if not k.startswith("cp/"))

    @property
    def cp_bytes(self) -> float:
        """Bytes over the context-parallel group."""
        return sum(v for k, v in self.moved.items() if k.startswith("cp/"))

    @property
    def cp_internode_bytes(self) -> float:
        return sum(v for k, v in self.crossed.items() if k.startswith("cp/"))


DP_AXES = ("dp", "dp_cp", "edp", "edp_cp", "hpz")
"""The axes gradients and parameters travel over (CommStats' names; dp_cp is the dp x cp group, edp_cp the
(dp / ep) x cp ranks holding the same experts)."""


def _families(layout, stage: int, rpn: int) -> dict[str, GroupFamily]:
    """dp (dp x cp with context parallelism), cp, edp (routed experts: (dp / ep) x cp), hpz and embedding groups
    of one stage; rank = ((s·dp + d)·cp + c)·tp + t. (hpZ runs without context parallelism: its groups at c = 0.)"""
    dp, cp, tp, s = layout.dp, layout.cp, layout.tp, stage

    def rank(d, t, st=s, c=0):
        return ((st * dp + d) * cp + c) * tp + t

    h = layout.hierarchical
    out = {"dp": GroupFamily("dp_cp" if cp > 1 else "dp", [[rank(d, t, c=c) for d in range(dp) for c in range(cp)]
                                                           for t in range(tp)], rpn, h),
           "cp": GroupFamily("cp", [[rank(d, t, c=c) for c in range(cp)] for d in range(dp) for t in range(tp)],
                             rpn, False),
           "edp": GroupFamily("edp_cp" if cp > 1 else "edp", [[rank(d, t, c=c) for d in range(j, dp, layout.ep)
                                                              for c in range(cp)] for t in range(tp)
                                                             for j in range(layout.ep)], rpn, h),
           "hpz": GroupFamily("hpz", [[rank(d, t) for d in range(a, a + layout.hpz)] for t in range(tp)
                                      for a in range(0, dp, layout.hpz)], rpn, False)}
    if layout.pp > 1 and s in (0, layout.pp - 1):
        out["embedding"] = GroupFamily("embedding", [[rank(d, t, 0, c), rank(d, t, layout.pp - 1, c)]
                                                     for d in range(dp) for c in range(cp) for t in range(tp)],
                                       rpn, False)
    return out


def cp_volume(spec, layout, blocks: int, fam: GroupFamily, vol: "Volume", w: int) -> None:
    """Add one step's context-parallel traffic of a stage holding `blocks` blocks to `vol` (module docstring)."""
    m = layout.num_microbatches
    for t in transfers(spec, layout, w):
        again = layout.recompute == "full" or (layout.recompute == "selective" and t.op != "all_reduce")
        times = t.count * blocks * m * (2 if again and not t.backward else 1)
        fam.op(t.op, t.numel, t.elem, vol, times)


def _quantized(numel: int, n: int) -> tuple[float, float]:
    """(int8 elements, fp32 scales) of a whole quantized collective over n ranks: n chunks of the bucket's
    n-th padded to whole blocks."""
    s = _ceil(numel // n, BLOCK)
    return n * s, n * s // BLOCK


def stage_volume(layout, groups, fam: dict, w: int) -> Volume:
    """The `Volume` of one stage with flat `groups` (memory_plan._Group) and group families `fam`."""
    vol, m = Volume({}, {}), layout.num_microbatches
    for g in groups:
        f = fam["edp"] if g.name == "experts" else fam["dp"]
        pp3 = g.stage == 3 and g.name != "experts"  # ZeRO++ runs on the stage-3 groups over dp
        for bk in g.layout.buckets:
            p = bk.numel
            if g.stage == 0 and layout.onebit:
                n = f.n
                if n > 1:
                    starts = [seg.buf_start - bk.start for seg in g.layout.segments_between(bk, bk.start, bk.end)]
                    padded, scales = onebit_sizes(p, n, starts)
                    f.op("all_to_all", padded / 8, 1, vol)
                    f.op("all_gather", n * scales, 4, vol)
                    f.op("all_gather", padded / 8, 1, vol)
                    f.op("all_reduce", scales, 4, vol)
            elif g.stage == 0:
                f.op("all_reduce", p, 4, vol)
            elif g.stage in (1, 2):
                f.op("reduce_scatter", p, 4, vol, m if g.stage == 2 else 1)
                f.op("all_gather", p, w, vol)
            else:
                gathers = (3 if bk.index == g.shared_bucket else 2) * m
                over_dp = 1 if pp3 and layout.hpz > 1 else gathers
                if pp3 and layout.quantized_weights:
                    q, sc = _quantized(p, f.n)
                    f.op("all_gather", q, 1, vol, over_dp)
                    f.op("all_gather", sc, 4, vol, over_dp)
                else:
                    f.op("all_gather", p, w, vol, over_dp)
                fam["hpz"].op("all_gather", p, w, vol, gathers - over_dp)
                if pp3 and layout.quantized_gradients:
                    q, sc = _quantized(p, f.n)
                    f.op("all_to_all", q, 1, vol, m)
                    f.op("all_to_all", sc, 4, vol, m)
                else:
                    f.op("reduce_scatter", p, 4, vol, m)
            if g.name == "tied" and "embedding" in fam:
                fam["embedding"].op("all_reduce", p if g.stage == 0 else p // g.layout.dp_size, 4, vol)
    fam["dp"].op("all_reduce", 1, 8, vol)  # the step's loss, fp64, averaged over dp (x cp)
    return vol


def predict_volume(spec, layout, hardware=None, param_persistence_threshold: int = 100_000) -> list[Volume]:
    """Per pipeline stage, the mean `Volume` of one step on one of its ranks. Nodes hold
    `layout.ranks_per_node` consecutive ranks, else the hardware's gpus_per_node (no hardware: one node)."""
    layout.check(spec)
    rpn = layout.ranks_per_node or (hardware.gpus_per_node if hardware is not None else layout.gpus)
    w = {"bf16": 2, "fp16": 2, "fp32": 4}[layout.precision]
    out = []
    for s, chunks in enumerate(pipeline_layers(spec, layout)):
        groups = flat_groups(spec, layout, chunks, param_persistence_threshold)
        fam = _families(layout, s, rpn)
        vol = stage_volume(layout, groups, fam, w)
        cp_volume(spec, layout, sum(kind == "block" for chunk in chunks for kind, _ in chunk), fam["cp"], vol, w)
        out.append(vol)
    return out
