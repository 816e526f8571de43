"""``python tools/plan.py --calibrate OUT.yaml [--ranks N]``: measure the machine at hand and write the hardware
file the planner then plans with (``--hardware OUT.yaml``).

The probe runs N ranks at once on this machine (as a run of N ranks would: on a CPU with fewer cores than
ranks they share them), each with max(1, cores // N) torch threads, and measures, as the planner's `Machine`
models them:

* GEMMs of (m x k)·(k x n) over a sweep of k and of sizes, in the training dtype (fp32 on a CPU, bf16 on a
  GPU): the fastest rate is the peak, and `gemm_max`, `gemm_k_half` are fitted to the others (least squares
  on the rate, e(k) = gemm_max·k / (k + gemm_k_half), the curve speed.py times every GEMM on);
* causal attention (SDPA) forward and backward at three shapes: `flash_fwd`, `flash_bwd` (the fraction of
  the GEMM peak it reaches, FLOPs counted as block_cost counts them);
* a memory-bound pass (a copy of 64 MiB): the memory bandwidth; a norm, an activation and a residual add
  forward and backward on 1-4 MiB activations: the fraction of it the elementwise kernels reach (`hbm`, bytes
  counted as block_cost counts them); the launch cost of a tiny op (`kernel_us`);
* GEMMs with small outputs over k (`gemm_mn_half`: the curve times mn / (mn + gemm_mn_half));
* on a CPU, the host time per dispatched operator in megazero's own step (`host_op_us`, `probe_host`), which
  a CPU pays in series with its compute (a GPU's host runs ahead: 0 there);
* on a CPU, one rank alone (all the cores): a probe model's training step against the planner's prediction of
  it from the kernels that rank measures just before (`in_step`, `probe_in_step`): the planner scales every
  compute second by it (1 on a GPU);
* all_reduce, reduce_scatter and all_gather over the N ranks at several sizes, and in groups of N / 2 and
  N / 4 ranks (every group at once): the bus bandwidth (`nvlink_gbs`: all ranks of this machine are one node)
  and the latency model `ring_base_us + steps · nvlink_hop_us` fitted over the group sizes; a send/receive
  between neighbours (`collective_us`, what p2p and all-to-all pay). Each is timed as a step meets it: right
  after a GEMM (`PACE`), by what it adds to the GEMM's time (on gloo with ranks sharing cores, several times
  what it costs called back to back); on a CPU also the CPU time it adds per second (`comm_cpu`: gloo's
  copies, reductions and wake-ups).

Every rank takes each measurement at the same time (a barrier before each), as a run's ranks compute, and the
compute probe times its kernels in turn, round after round (`probe_timing.interleaved`; the launch cost `kernel_us` on its
own): a shared host's speed drifts over seconds, and kernels timed one after the other would see different
speeds. Its GEMM operands (cycled through 64 MiB per shape) are all alive at once: about 1 GiB per rank. On a
CPU with fewer cores than N (`probe`) each rank times its compute in CPU seconds (what a core of its own would
take, with the caches and switches that sharing costs) and the file records ``cores_per_node``: the planner
shares the cores among the N ranks itself (`speed.shared_cores_bound`). The file holds the `Hardware` fields
and an ``efficiency`` section of `Efficiency` fields; the link bandwidth fractions are 1 (the figures are
measured, not datasheet values). On a GPU node the same command measures the GPU and NCCL.
"""
from __future__ import annotations

import itertools
import math
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist

from megazero.core.launch_env import LaunchEnv
from megazero.toolbox.probe_timing import calls_for, interleaved, median_seconds, medians
from megazero.toolbox.step_probe import probe_host, probe_in_step
from megazero.runtime.device import compute_device

GEMM_SHAPES = ([(1024, 1024, k) for k in (32, 64, 128, 256, 512, 1024, 2048)] + [(n, n, n) for n in (256, 512)]
               + [(m, n, k) for m, n in ((256, 256), (256, 1024), (128, 512)) for k in (64, 256, 1024)])
"""(m, n, k) of the GEMM sweep: k from a head dim to a wide MLP, squares, and small outputs (m·n) over k."""
COLLECTIVE_BYTES = (16 << 10, 1 << 20, 8 << 20)
KINDS = ("all_reduce", "reduce_scatter", "all_gather")


ATTENTION_SHAPES = [(16, 128, 32), (16, 256, 32), (8, 256, 64)]
"""(batch x heads, sequence, head dim) of the causal attention probe."""
ELEMENTWISE_ROWS = (256, 1024)
"""Rows of the (rows, 1024) activations the memory-bound probe runs its kernels on (1-4 MiB in fp32)."""


def probe_compute(device: torch.device, dtype: torch.dtype, repeats: int = 5, barrier=lambda: None,
                  clock=time.perf_counter) -> dict:
    """{"gemm": [(m, n, k, FLOP/s)], "attention": [(bh, s, d, fwd FLOP/s, bwd FLOP/s)],
    "elementwise_bytes_per_s", "copy_bytes_per_s", "kernel_s"} measured on this rank, on `clock` (ranks
    sharing cores time their CPU time: what a core of its own would take, with the caches and switches that
    sharing costs), every kernel timed in turn each round (`probe_timing.interleaved`). `barrier` runs before each
    measurement, so that ranks sharing a machine measure at the same time (as a run's ranks compute)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    flops_s, bytes_s = (1e14, 1e12) if device.type == "cuda" else (1e11, 1e10)  # only sizes the samples
    samples, work = [], []  # (fn, calls) and what one call does (FLOPs or bytes as the planner counts them)
    for m, n, k in GEMM_SHAPES:
        # operands cycled through 64 MiB, as a model's weights and activations stream through the caches
        count = max(1, min(64, (64 << 20) // ((m * k + k * n) * torch.finfo(dtype).bits // 8)))
        operands = itertools.cycle([(torch.randn(m, k, device=device, dtype=dtype),
                                     torch.randn(k, n, device=device, dtype=dtype)) for _ in range(count)])
        samples.append((lambda ops=operands: torch.mm(*next(ops)), calls_for(2.0 * m * n * k, flops_s)))
        work.append(2.0 * m * n * k)
    for bh, s, d in ATTENTION_SHAPES:  # causal: half the square, as the planner counts it
        q, k, v = (torch.randn(1, bh, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        flops = 2.0 * bh * s * s * d
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        samples += [(lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                     calls_for(flops, flops_s / 4)),
                    (lambda out=out, qkv=(q, k, v), grad=torch.ones_like(out):
                     torch.autograd.grad(out, qkv, grad, retain_graph=True), calls_for(2.5 * flops, flops_s / 4))]
        work += [flops, 2.5 * flops]
    for rows in ELEMENTWISE_ROWS:  # a norm, an activation and a residual add, forward and backward
        x = torch.randn(rows, 1024, device=device, dtype=dtype, requires_grad=True)
        r = torch.randn(rows, 1024, device=device, dtype=dtype)
        norm = torch.nn.LayerNorm(1024, device=device, dtype=dtype)

        def kernels(x=x, r=r, norm=norm):
            y = torch.nn.functional.gelu(norm(x)) + r
            y.backward(r)
        # bytes as the planner counts them (block_cost._elementwise): a norm 2, a residual add 3 and an
        # activation 2 elements' worth per element forward, twice that backward
        nbytes = 21 * x.numel() * x.element_size()
        samples.append((kernels, calls_for(nbytes, bytes_s)))
        work.append(nbytes)
    x = torch.empty(16 << 20, device=device, dtype=torch.float32)  # 64 MiB
    y = torch.empty_like(x)
    samples.append((lambda: y.copy_(x), calls_for(2 * x.numel() * 4, bytes_s)))
    work.append(2 * x.numel() * 4)
    rates = [w / seconds for w, seconds in zip(work, interleaved(samples, repeats, sync, barrier, clock))]
    g, a = len(GEMM_SHAPES), 2 * len(ATTENTION_SHAPES)
    gemm = [(m, n, k, rate) for (m, n, k), rate in zip(GEMM_SHAPES, rates)]
    attention = [(bh, s, d, rates[g + 2 * i], rates[g + 2 * i + 1]) for i, (bh, s, d) in enumerate(ATTENTION_SHAPES)]
    tiny = torch.zeros(1, device=device)
    barrier()
    kernel = median_seconds(lambda: tiny.add_(1.0), repeats * 20, sync, calls=1000, clock=clock)
    return {"gemm": gemm, "attention": attention, "elementwise_bytes_per_s": statistics.median(rates[g + a:-1]),
            "copy_bytes_per_s": rates[-1], "kernel_s": kernel}


def fit_gemm(rates: list[tuple[int, int, int, float]]) -> tuple[float, float, float, float]:
    """(peak FLOP/s, gemm_max, gemm_k_half, gemm_mn_half): the peak is the fastest rate measured, and the
    curve rate = peak·gemm_max·k / (k + gemm_k_half)·mn / (mn + gemm_mn_half) is fitted to the rates by least
    squares on their logs (a grid over gemm_k_half and gemm_mn_half, gemm_max then in closed form)."""
    peak = max(r for *_, r in rates)
    logs = [math.log(r / peak) for *_, r in rates]
    best = None
    for k_half in [x * 2.0 for x in range(0, 1001)]:  # 0 .. 2000
        for mn_half in [0.0] + [2.0 ** (x / 2) for x in range(24, 49)]:  # 4096 .. 16M
            basis = [math.log(k / (k + k_half) * (m * n / (m * n + mn_half))) for m, n, k, _ in rates]
            log_g = sum(t - b for b, t in zip(basis, logs)) / len(logs)
            err = sum((log_g + b - t) ** 2 for b, t in zip(basis, logs))
            if best is None or err < best[0]:
                best = (err, math.exp(log_g), k_half, mn_half)
    return peak, best[1], best[2], best[3]


def fit_latency(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(base, per step) seconds from (ring steps, latency) points, least squares (both >= 0)."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0
    slope = max(0.0, slope)
    return max(0.0, mean_y - slope * mean_x), slope


def _collective(kind: str, numel: int, group, size: int, device: torch.device):
    if kind == "all_reduce":
        t = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(t, group=group)
    out = torch.empty(numel // size * size, device=device)
    shard = torch.empty(numel // size, device=device)
    if kind == "reduce_scatter":  # torch's current names, as megazero.runtime.comm calls them
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: fn(shard, out, group=group)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return lambda: fn(out, shard, group=group)


PACE = (256, 256, 1024)
"""(m, n, k) of the GEMM each collective and transfer is timed after: the compute a step runs between two of them
(a block's GEMMs at a debug size), so that it is timed as a step meets it (on a CPU whose ranks share cores a
collective costs several times more after compute than called back to back)."""
PACE_CALLS = 8


def _paced_seconds(fn, baseline: tuple, repeats: int, sync, pace) -> tuple[float, float]:
    """(wall, CPU) seconds `fn` adds to the pacing GEMM `pace` (each call: the GEMM, then `fn`) over `baseline`
    (the GEMM's own, `_wall_and_cpu`): medians of `repeats` samples of `PACE_CALLS` calls."""
    def paced():
        torch.mm(*pace)
        fn()
    wall, cpu = _wall_and_cpu(paced, repeats, sync)
    return max(0.0, wall - baseline[0]), max(0.0, cpu - baseline[1])


def _wall_and_cpu(fn, repeats: int, sync) -> tuple[float, float]:
    """(wall, CPU seconds of this process: every thread, gloo's too) per call of `fn`, medians of `repeats`
    samples of `PACE_CALLS` calls."""
    wall, cpu = medians(fn, repeats, sync, 0.0, PACE_CALLS, (time.perf_counter, time.process_time))
    return wall, cpu


def _partition(world: int, size: int) -> dict:
    """{rank: its group}: the world in consecutive groups of `size` ranks (every rank creates every group)."""
    groups = {}
    for first in range(0, world - world % size, size):
        ranks = list(range(first, first + size))
        group = dist.new_group(ranks)
        groups.update(dict.fromkeys(ranks, group))
    return groups


def _rank_probe(rank: int, world: int, port: int, queue, repeats: int, parts: tuple = ("compute", "comm"),
                share_cores: bool = True) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # the ranks of one node: rank = local rank; a GPU node: the GPU in bf16 and NCCL, else the CPU in fp32 and gloo
    device = compute_device(LaunchEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world))
    gpu = device.type == "cuda"
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    shared = share_cores and not gpu and world > (os.cpu_count() or 1)
    try:
        compute = (probe_compute(device, torch.bfloat16 if gpu else torch.float32, repeats, dist.barrier,
                                 clock=time.process_time if shared else time.perf_counter)
                   if "compute" in parts else None)
        if "host" in parts:  # measured alone (`probe`); the host runs ahead of a GPU
            compute = {"host_op_s": 0.0, "in_step": 1.0} if gpu else _alone(device, repeats)
        comm, p2p = {}, None
        if "comm" in parts:
            m, n, k = PACE
            pace = (torch.randn(m, k, device=device), torch.randn(k, n, device=device))
            dist.barrier()
            baseline = _wall_and_cpu(lambda: torch.mm(*pace), repeats, sync)
            sizes = sorted({s for s in (world, world // 2, world // 4) if s >= 2})
            for size in sizes:
                groups = _partition(world, size)  # every group measures at once, as a layout's groups run
                for kind in KINDS:
                    for nbytes in COLLECTIVE_BYTES:
                        dist.barrier()
                        if rank in groups:
                            fn = _collective(kind, nbytes // 4, groups[rank], size, device)
                            comm[(kind, size, nbytes)] = _paced_seconds(fn, baseline, repeats, sync, pace)
            if world >= 2:  # a send and a receive between neighbours (every pair at once), per transfer
                t = torch.ones(256, device=device)
                peer = rank ^ 1

                def pingpong():
                    if rank % 2 == 0:
                        dist.send(t, peer)
                        dist.recv(t, peer)
                    else:
                        dist.recv(t, peer)
                        dist.send(t, peer)
                dist.barrier()
                if peer < world:
                    wall, cpu = _paced_seconds(pingpong, baseline, repeats, sync, pace)
                    p2p = (wall / 2, cpu / 2)
            dist.barrier()
        queue.put((rank, compute, comm, p2p, gpu))
    finally:
        dist.destroy_process_group()


def _alone(device: torch.device, repeats: int, pairs: int = 3) -> dict:
    """{"host_op_s", "in_step"}: a CPU's host time per operator (`probe_host`) and its step's compute over its
    kernels' (`probe_in_step`, against this rank's compute measured alone in wall seconds just before: the
    median of `pairs` such pairs, the machine's speed drifting between them)."""
    host = probe_host(repeats)
    ratios = []
    for _ in range(pairs):
        compute = dict(probe_compute(device, torch.float32, repeats), host_op_s=host, in_step=1.0)
        ratios.append(probe_in_step(hardware_file([(0, compute, {}, None, False)], "alone"), repeats))
    return {"host_op_s": host, "in_step": statistics.median(ratios)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, repeats: int = 5, timeout: float = 600.0, parts: tuple = ("compute", "comm"),
            share_cores: bool = True) -> list:
    """Run the probe's `parts` on `world` ranks of this machine (gloo, or NCCL on GPUs); [(rank, compute, comm,
    p2p, on a GPU)] in rank order: comm {(kind, ranks, bytes): (wall, CPU) seconds added}, p2p (wall, CPU)
    seconds per transfer (None on a rank without a neighbour)."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_probe, args=(r, world, port, queue, repeats, parts, share_cores))
             for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(timeout)
    return sorted(results, key=lambda r: r[0])


def probe_alone(repeats: int = 5) -> dict:
    """{"host_op_s", "in_step"} of this machine, measured by one rank alone (`_alone`; a GPU: 0 and 1, its host
    runs ahead of it): what `probe` adds to every rank count's file."""
    if torch.cuda.is_available():
        return {"host_op_s": 0.0, "in_step": 1.0}
    return measure(1, repeats, parts=("host",))[0][1]


def probe(world: int, repeats: int = 5, name: str | None = None, share_cores: bool = True,
          alone: dict | None = None) -> dict:
    """The hardware file's content for runs of `world` ranks on this machine, every rank measuring at once. On a
    CPU with fewer cores than `world` each rank times its compute in CPU seconds (what it would take on a core
    of its own, the cost of sharing included) and the file records ``cores_per_node``: the planner shares the
    cores among the ranks (`speed.shared_cores_bound`). `share_cores=False`: wall time throughout, no ``cores_per_node``.
    `alone`: `probe_alone`'s figures when already measured (one per machine serves every rank count)."""
    results = measure(world, repeats, share_cores=share_cores)
    alone = probe_alone(repeats) if alone is None else alone
    compute = [(r[0], dict(r[1], **alone), *r[2:]) for r in results]
    content = hardware_file(results, name or f"this machine, {world} ranks", compute)
    if not share_cores or world <= (os.cpu_count() or 1):  # no sharing left to model
        content.pop("cores_per_node", None)
    return content


def hardware_file(results: list, name: str, compute: list | None = None) -> dict:
    """The hardware file's content (`Hardware` fields and an ``efficiency`` section) from `measure`'s results
    (the compute figures from `compute`'s, default the same): the median over the ranks of each figure."""
    world = len(results)
    gpu = results[0][4]
    comm = results[0][2]
    # CPU seconds per second of communication, over every rank's collectives and transfers
    spent = [c / w for r in results for w, c in [*r[2].values(), *([r[3]] if r[3] else [])] if w > 0]
    results = compute or results
    rates = [(m, n, k, statistics.median(r[1]["gemm"][i][3] for r in results))
             for i, (m, n, k, _) in enumerate(results[0][1]["gemm"])]
    peak, gemm_max, k_half, mn_half = fit_gemm(rates)
    copy = statistics.median(r[1]["copy_bytes_per_s"] for r in results)
    elementwise = statistics.median(r[1]["elementwise_bytes_per_s"] for r in results)
    flash = [(statistics.median(r[1]["attention"][i][3] for r in results),
              statistics.median(r[1]["attention"][i][4] for r in results)) for i in range(len(ATTENTION_SHAPES))]
    flash_fwd = statistics.median(f for f, _ in flash) / peak  # of the measured GEMM peak, as block_cost uses it
    flash_bwd = statistics.median(b for _, b in flash) / peak
    kernel = statistics.median(r[1]["kernel_s"] for r in results)
    host = statistics.median(r[1]["host_op_s"] for r in results)
    in_step = statistics.median(r[1].get("in_step", 1.0) for r in results)
    big = max(COLLECTIVE_BYTES)
    busbw, latency = [], []
    comm_cpu = 0.0 if gpu or not spent else statistics.median(spent)
    comm = {key: wall for key, (wall, _) in comm.items()}
    for (kind, size, nbytes), seconds in comm.items():
        factor = 2.0 if kind == "all_reduce" else 1.0
        steps = factor * (size - 1)
        small = comm[(kind, size, min(COLLECTIVE_BYTES))]
        if nbytes == big and seconds > small:  # (noise can make a paced difference of the two 0)
            bus = factor * (size - 1) / size * (nbytes - min(COLLECTIVE_BYTES)) / max(seconds - small, 1e-9)
            busbw.append(bus)
        if nbytes == min(COLLECTIVE_BYTES):
            latency.append((steps, seconds))
    base, hop = fit_latency(latency) if latency else (0.0, 0.0)
    p2p = next((r[3][0] for r in results if r[3] is not None), 0.0)
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30 / world
    bus = statistics.median(busbw) if busbw else copy
    cores = {} if gpu else {"cores_per_node": os.cpu_count() or 1}
    return {"name": name, "peak_tflops": (1 if gpu else 2) * peak / 1e12,  # fp32 GEMMs run at half the peak
            "hbm_gib": round(mem_gib, 2), "hbm_bandwidth_tbs": copy / 1e12, "gpus_per_node": world,
            "nvlink_gbs": bus / 1e9, "internode_gbs": bus / 1e9,
            "efficiency": {"gemm_max": round(gemm_max, 4), "gemm_k_half": round(k_half, 1),
                           "gemm_mn_half": round(mn_half, 1), "host_op_us": round(host * 1e6, 3),
                           "in_step": round(in_step, 4), "comm_cpu": round(comm_cpu, 4),
                           "hbm": round(min(1.0, elementwise / copy), 4), "flash_fwd": round(flash_fwd, 4),
                           "flash_bwd": round(flash_bwd, 4),
                           "nvlink": 1.0, "internode": 1.0, "kernel_us": kernel * 1e6,
                           "collective_us": p2p * 1e6, "ring_base_us": base * 1e6, "nvlink_hop_us": hop * 1e6,
                           "net_hop_us": hop * 1e6, "host_gbs": copy / 1e9, "pcie_gbs": copy / 1e9}, **cores}


def write(path: str, content: dict, measured_ranks: int) -> None:
    """Write `content` as the YAML hardware file at `path`."""
    lines = [f"# measured by python tools/plan.py --calibrate on {measured_ranks} ranks of this machine "
             f"({time.strftime('%Y-%m-%d')}); plan with --hardware {path}"]
    for key, value in content.items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            lines += [f"  {k}: {_num(v)}" for k, v in value.items()]
        else:
            lines.append(f"{key}: {value if isinstance(value, str) and key != 'name' else _num(value)}"
                         if key != "name" else f"name: {value!r}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _num(v) -> str:
    return str(v) if isinstance(v, int) else f"{v:.6g}" if math.isfinite(v) else "0"
