"""The hardware as the step-time model sees it (pure: no torch): achievable fractions of the datasheet
(`Efficiency`, two of them fitted, see speed.py), how the framework runs a block (`Implementation`), and
`Machine`: the seconds of one GEMM, one memory-bound pass, one collective on a group of ranks.

Rank order (megazero's `Topology`, pp outermost, tp innermost, cp just outside tp): rank = ((pp·dp + d)·cp +
c)·tp + t, so the dp x cp group (ZeRO's) is dp·cp ranks tp apart and the cp group cp ranks tp apart. A group of
ranks `stride` apart stays on NVLink inside a node; a ring that spans nodes has k = gpus_per_node /
stride members per node, whose k rings leave each node through k NICs: bus bandwidth
min(NVLink, k·inter-node). An all-to-all over such a group sends each GPU's share for the members in
its node on NVLink and the rest through its own NIC, both at once: the slower of the two. Nodes hold
the layout's ``ranks_per_node`` ranks (None: the hardware's gpus_per_node).

Hierarchical data-parallel collectives (``comm.hierarchical``, `Machine.dp_collective`), for a group
with k > 1 members in each of N > 1 nodes: inside the node on NVLink, between the nodes a ring over
one member per node carrying 1/k of the bytes, the k members' rings through their own NICs in
parallel; the levels run one after another, as megazero's runtime runs them (synchronously: never
hidden behind compute). An all-reduce of T bytes: 2(k−1)/k·T / NVLink + 2(N−1)/N·T/k / inter-node;
a reduce-scatter or all-gather half of that. The flat ring's bus bandwidth is min(NVLink,
k·inter-node): the two-level form gains when the inter-node links are slow next to NVLink (few NICs
per node), and always sends fewer bytes across nodes (comm_volume.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

@dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of the datasheet figures. gemm_max, gemm_k_half: fitted (see
    `DEFAULT_EFFICIENCY`); the rest are stated: hbm (a STREAM-like copy reaches ~0.8 of datasheet
    HBM bandwidth), nvlink / internode (NCCL ring bus bandwidth over the per-direction link rate:
    ~0.8 on NVLink, ~0.9 on InfiniBand), flash_fwd / flash_bwd (FlashAttention-2's reported causal
    fraction of A100 peak, head dim 64-128), a fixed latency per kernel and per all-to-all or p2p
    transfer, the host side of offload (host memory bandwidth per GPU, PCIe Gen4 x16 effective), and
    the latency of a ring or tree collective as NCCL's own cost model states it (src/graph/tuning.cc,
    Simple protocol, the one large messages use): a base of ring_base_us plus, per ring step, nvlink_hop_us
    inside a node or net_hop_us between nodes (`Machine.latency`)."""

    gemm_max: float = 0.7824
    gemm_k_half: float = 391.8
    gemm_mn_half: float = 0.0  # measured by --calibrate on a CPU: small outputs (m·n) run below the curve
    host_op_us: float = 0.0  # a CPU (--calibrate): host time per dispatched operator, paid in series with compute
    comm_cpu: float = 0.0  # a CPU (--calibrate): CPU seconds a rank spends per second of collective or transfer
    in_step: float = 1.0  # a CPU (--calibrate): a step's compute seconds over its kernels' timed alone (`Machine`)
    hbm: float = 0.8
    nvlink: float = 0.8
    internode: float = 0.9
    flash_fwd: float = 0.55
    flash_bwd: float = 0.45
    kernel_us: float = 4.0
    collective_us: float = 15.0
    ring_base_us: float = 8.4
    nvlink_hop_us: float = 3.4
    net_hop_us: float = 9.6
    host_gbs: float = 25.0
    pcie_gbs: float = 20.0

    def replace(self, **changes) -> "Efficiency":
        return replace(self, **changes)


DEFAULT_EFFICIENCY = Efficiency()
"""Fitted by `calibrate` on A100 80GB (configs/hardware/a100-80gb.yaml) to the five rows of `CALIBRATION`
(least squares on log TFLOP/s; the other fields are the stated defaults, the collectives' latencies NCCL's
own model): gemm_max = 0.7824, gemm_k_half = 391.8 (the pipeline simulated with batched, non-blocking p2p
as Megatron and megazero's NCCL path run it). A large GEMM with k = 8192 then runs at 0.75 of peak
(233 TFLOP/s), k = 2304 at 0.67, k = 768 (the 18.4B row's out projection per TP rank) at 0.52, and the
attention's QKᵀ over a head dim of 96-128 at 0.16-0.20 (unfused attention is expensive at small hidden sizes;
the fit leans on that to separate the 1.7B and 3.6B rows from the 39.1B one). Residuals, predicted /
published hardware TFLOP/s per GPU - 1: 1.7B -1.0%, 3.6B +0.3%, 7.5B +1.3%, 18.4B +2.0%, 39.1B -2.5% (135.6,
138.4, 143.8, 137.7, 134.6 against 137, 138, 142, 135, 138). Before NCCL's latency model (a fixed 15 us per
collective) and batched p2p the fit was 0.7721, 366.9 with residuals within 0.1% of these."""


@dataclass(frozen=True)
class Implementation:
    """How the framework runs a block: fused_qkv (one qkv GEMM, Megatron) or three (megazero);
    tp_overlap: backward's input-grad all-reduce overlaps the weight-grad GEMMs; grad_bytes: bytes
    per gradient element in the data-parallel reduction; p2p_scatter_gather: each TP rank sends 1/t
    of a pipeline activation and the receivers all-gather it on NVLink (Megatron 2021)."""

    name: str = "megazero"
    fused_qkv: bool = False
    tp_overlap: bool = True
    grad_bytes: int = 4
    p2p_scatter_gather: bool = False


MEGAZERO = Implementation()
MEGATRON_SC21 = Implementation("megatron-lm (SC21)", fused_qkv=True, tp_overlap=False, grad_bytes=2,
                               p2p_scatter_gather=True)




class Machine:
    """The hardware as seen by the model: effective rates in bytes/s and FLOP/s."""

    def __init__(self, hw, eff: Efficiency, layout):
        eff = hw.tuned(eff) if hasattr(hw, "tuned") else eff  # a calibrated machine's measured fractions
        self.hw, self.eff = hw, eff
        self.peak = hw.peak_tflops * 1e12 * (0.5 if layout.precision == "fp32" else 1.0)  # fp32: TF32 rate
        self.peak32 = hw.peak_tflops * 1e12 * 0.5  # fp32 GEMMs in any precision (ring attention's blocks)
        self.hbm = hw.hbm_bandwidth_tbs * 1e12 * eff.hbm
        self.nvlink = hw.nvlink_gbs * 1e9 * eff.nvlink
        self.internode = hw.internode_gbs * 1e9 * eff.internode
        self.act = 4 if layout.precision == "fp32" else 2  # bytes per activation / parameter element
        self.node = layout.ranks_per_node or hw.gpus_per_node  # ranks per node
        self.hierarchical = layout.hierarchical
        # a CPU node that runs more ranks than it has cores (``cores_per_node`` of a calibrated file): the rates
        # here are a core of its own; speed.py shares the cores among the ranks computing at once (0: no sharing)
        cores = getattr(hw, "cores_per_node", 0)
        self.ranks_here = min(layout.gpus, self.node)  # ranks on one node
        self.shared_cores = cores if self.ranks_here > cores else 0
        # a CPU's step takes longer than the planner's sum of its kernels timed alone (a profile of a debug GPT:
        # its GEMMs as predicted, attention, the elementwise kernels, the head, loss and optimizer slower):
        # ``in_step``, measured by --calibrate as one probe model's whole step over its prediction, host time
        # included (`megazero.toolbox.calibrate.probe_in_step`), scales every compute second below, GEMMs and host
        # time too: an empirical correction from one model, not a per-kernel rate (1 on a GPU and the presets)
        self.in_step = eff.in_step

    def gemm(self, m: float, n: float, k: float, batch: float = 1) -> float:
        """One (m x k)·(k x n) GEMM (`batch` of them in one batched kernel)."""
        return self._gemm(m, n, k, batch, self.peak, self.act)

    def gemm32(self, m: float, n: float, k: float, batch: float = 1) -> float:
        """`gemm` in fp32 whatever the layout's precision (4-byte elements at the fp32 rate, `peak32`)."""
        return self._gemm(m, n, k, batch, self.peak32, 4)

    def _gemm(self, m: float, n: float, k: float, batch: float, peak: float, elem: int) -> float:
        e = self.eff.gemm_max * k / (k + self.eff.gemm_k_half)
        if self.eff.gemm_mn_half:  # a small output is fewer tiles than the cores / threads take at once
            e *= m * n / (m * n + self.eff.gemm_mn_half)
        compute = 2.0 * m * n * k * batch / (e * peak)
        memory = elem * (m * k + k * n + m * n) * batch / self.hbm
        return (max(compute, memory) + self.eff.kernel_us * 1e-6) * self.in_step

    def flops(self, flops: float, fraction: float) -> float:
        """Seconds of `flops` at `fraction` of the peak (a fused kernel's measured rate, e.g. flash attention)."""
        return flops / (fraction * self.peak) * self.in_step

    def mem(self, nbytes: float, kernels: int = 1) -> float:
        """Seconds of `kernels` memory-bound kernels moving `nbytes` in all."""
        return (nbytes / self.hbm + kernels * self.eff.kernel_us * 1e-6) * self.in_step

    def host(self, ops: float) -> float:
        """Seconds the host spends dispatching `ops` operators (Python, the dispatcher, autograd) where it runs
        them in series with the compute: a CPU measured by --calibrate (`host_op_us`); 0 on accelerators,
        whose host runs ahead of the device."""
        return ops * self.eff.host_op_us * 1e-6 * self.in_step

    def link(self, stride: int, size: int) -> float:
        """Bus bandwidth (bytes/s) of a ring over `size` ranks `stride` apart (see the module docstring)."""
        g = self.node
        if stride * size <= g:
            return self.nvlink
        per_node = max(1, g // stride)
        return min(self.nvlink, per_node * self.internode) if per_node > 1 else self.internode

    def latency(self, kind: str, size: int, stride: int = 1) -> float:
        """Seconds of latency of one all_reduce / reduce_scatter / all_gather over `size` ranks `stride` apart,
        NCCL's model (see `Efficiency`): a ring takes size - 1 steps (twice for an all-reduce), those between
        nodes at net_hop_us, the rest at nvlink_hop_us; an all-reduce may take the tree instead, 2·((k - 1)
        steps in the node + log2(nodes) between nodes), whichever is shorter. At 1,024 ranks over 128 nodes a
        ring reduce-scatter or all-gather waits ~4 ms however small the message: what ZeRO-3's per-layer
        collectives meet at scale."""
        if size <= 1:
            return 0.0
        e = self.eff
        k = max(1, min(size, self.node // stride)) if stride <= self.node else 1  # members per node
        nodes = -(-size // k)
        twice = 2 if kind == "all_reduce" else 1
        steps, inter = twice * (size - 1), twice * (nodes - 1)
        ring = e.ring_base_us + (steps - inter) * e.nvlink_hop_us + inter * e.net_hop_us
        if kind == "all_reduce":
            tree = e.ring_base_us + 2 * ((k - 1) * e.nvlink_hop_us + math.log2(nodes) * e.net_hop_us)
            ring = min(ring, tree)
        return ring * 1e-6

    def ring(self, kind: str, nbytes: float, size: int, bandwidth: float, stride: int = 1, count: float = 1) -> float:
        """all_reduce / reduce_scatter / all_gather of `nbytes` (the full tensor, in all) over `size` ranks
        `stride` apart, in `count` collectives (buckets, layers): the bytes at `bandwidth`, each collective's
        `latency`."""
        if size <= 1 or nbytes <= 0:
            return 0.0
        factor = 2.0 if kind == "all_reduce" else 1.0
        return factor * (size - 1) / size * nbytes / bandwidth + max(1.0, count) * self.latency(kind, size, stride)

    def two_level(self, stride: int, size: int) -> tuple[int, int] | None:
        """(k members per node, N nodes) when a data-parallel group of `size` ranks `stride` apart runs
        its collectives in two levels (hierarchical, k > 1 and N > 1), else None."""
        k = self.node // stride if stride <= self.node else 1
        if not self.hierarchical or stride * size <= self.node or k <= 1 or size % k:
            return None
        return k, size // k

    def dp_collective(self, kind: str, nbytes: float, size: int, stride: int, count: float = 1) -> float:
        """A data-parallel all_reduce / reduce_scatter / all_gather of `nbytes` (the full tensor, in `count`
        collectives) over `size` ranks `stride` apart: the flat ring, or two levels (module docstring)."""
        levels = self.two_level(stride, size)
        if levels is None:
            return self.ring(kind, nbytes, size, self.link(stride, size), stride, count)
        k, nodes = levels
        inter = self.ring(kind, nbytes / k, nodes, self.internode, self.node, count)
        if kind == "all_reduce":
            return (self.ring("reduce_scatter", nbytes, k, self.nvlink, stride, count) + inter
                    + self.ring("all_gather", nbytes, k, self.nvlink, stride, count))
        return self.ring(kind, nbytes, k, self.nvlink, stride, count) + inter

    def all_to_all(self, sent: float, size: int, stride: int) -> float:
        """An all-to-all in which this rank sends `sent` bytes, spread evenly over the other members of a
        group of `size` ranks `stride` apart: the share for members in its node on NVLink, the rest
        through its own inter-node link at the same time (the slower sets the time)."""
        if size <= 1:
            return 0.0
        g = self.node
        near = size if stride * size <= g else max(1, g // stride)  # members per node
        inside = sent * (near - 1) / (size - 1)
        return max(inside / self.nvlink, (sent - inside) / self.internode) + self.eff.collective_us * 1e-6


def add_parts(*parts: dict) -> dict:
    out: dict = {}
    for p in parts:
        for k, v in p.items():
            out[k] = out.get(k, 0.0) + v
    return out


def scale_parts(parts: dict, factor: float) -> dict:
    return {k: v * factor for k, v in parts.items()}
