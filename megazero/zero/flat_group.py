"""One flat buffer group of ZeRO: its parameters, gradients, fp32 master copy and optimizer state.

Each data-parallel rank *owns* one slice of every bucket (the whole bucket at stage 0, the r-th of
dp_size equal slices at stages 1-3; see megazero/core/flat_buffer.py). Everything the optimizer touches is kept per
bucket over that owned range: `grad_owned[b]` (fp32, the reduced gradient), `master[b]` (fp32
weights), `exp_avg[b]`, `exp_avg_sq[b]`.

Storage by stage (Ψ = this group's parameters, Nd = dp size):
- working params: a full flat buffer the parameters are views of (stages 0-2), or only the owned
  shard (stage 3, `shard_params=True`), gathered per bucket when a layer runs.
- gradients: a full fp32 flat buffer accumulated over micro-batches and reduced once per step
  (stages 0-1, `full_grads=True`), or an fp32 owned shard that each micro-batch's bucket is
  reduce-scattered into (stages 2-3).
- master: a view of the working buffer when the working dtype is fp32 and the optimizer is not
  offloaded (no copy, as in the ZeRO paper's fp32 accounting), else a separate fp32 tensor (on the
  CPU when offloaded).

Host buffers (an offloaded parameter shard; an offloaded master, Adam moments and gradient staging) are
page-locked when their flag asks for it and CUDA exists (`host_pinned`): `pin_params` for the shard,
`pin_optimizer` for the rest (zero.offload_param.pin_memory / zero.offload_optimizer.pin_memory, see
`grouping.make_groups`). Pinned, the copies to and from the device are asynchronous DMA; unpinned, they
go through CUDA's staging buffer (the same values, the host waiting).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.runtime import comm
from megazero.runtime.comm import GroupHandle, after
from megazero.core.flat_buffer import FlatLayout, build_layout
from megazero.zero.partitioned_init import full_shape, full_value, is_partitioned
from megazero.zero.zeropp import ZeroPlusPlus, quantized_all_gather, quantized_reduce_scatter


def host_pinned(requested: bool, cuda_available: bool) -> bool:
    """Whether a host buffer is allocated page-locked: when its pin_memory flag asks for it and CUDA is
    available (pinning needs a CUDA runtime; on a CPU-only machine every buffer is ordinary memory).
    Local: no communication."""
    return requested and cuda_available


def _flat_views(flat: torch.Tensor, ranges: list[tuple[int, int]], base: int = 0) -> list[torch.Tensor]:
    return [flat[s - base:e - base] for s, e in ranges]


class SlotPool:
    """The fp32 bucket slots of one flat group (stages 2-3: a micro-batch's gradients of one bucket,
    then the input of its reduce-scatter): made in the first micro-batch that needs them and reused by
    every later one, instead of a bucket-sized allocation per bucket and micro-batch (2 GB each at
    DeepSpeed's default 5e8 elements). `take(numel)` hands out a zeroed free slot of exactly that size or
    makes one; `give_back` returns it once the reduction no longer reads it (at its end on an
    accelerator, where NCCL reads its input until then, and for a hierarchical chain, which runs later;
    at its launch on the CPU, where gloo copies its input first: holding it to the end cost a bucket per
    reduction in flight, measured; see `comm.input_read_at_launch`). The pool
    holds as many slots as were filling or reducing at once: one, or FlatGroup.MAX_INFLIGHT + 1 with
    overlap_comm, more while complete buckets wait for their turn (see `trim` for a data-dependent
    graph's). `made` counts them. Local: no communication."""

    def __init__(self, device):
        self.device = device
        self.free: list[torch.Tensor] = []
        self.slots: list[torch.Tensor] = []

    @property
    def made(self) -> int:
        return len(self.slots)

    def take(self, numel: int) -> torch.Tensor:
        for i, t in enumerate(self.free):
            if t.numel() == numel:
                return self.free.pop(i).zero_()
        slot = torch.zeros(numel, dtype=torch.float32, device=self.device)
        self.slots.append(slot)
        return slot

    def give_back(self, slot: torch.Tensor) -> None:
        self.free.append(slot)

    def trim(self, keep: int) -> None:
        """Between micro-batches (every slot free): keep the `keep` largest. For reductions launched at
        a unit's end (`megazero.zero.unit_ends.UnitEnds`: a unit's buckets all alive at once, a ZeRO-3
        layer's fp32 gradients), which held for the run would sit on the next forward's peak: those
        beyond `keep` are made again in each micro-batch."""
        if len(self.free) == len(self.slots) and len(self.slots) > keep:
            self.free.sort(key=lambda t: -t.numel())
            self.free, dropped = self.free[:keep], self.free[keep:]
            self.slots = [t for t in self.slots if all(t is not d for d in dropped)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slots)


class FlatGroup:
    """Flat storage and per-bucket communication for one list of parameters.

    Communicates over `dp_group` only: all-reduce (stage 0) or reduce-scatter (1-3) of gradient
    buckets, all-gather of updated (stages 1-2) or used (stage 3) parameter buckets.
    """

    MAX_INFLIGHT = 2  # asynchronous gradient reductions launched and not yet waited for, the newest included

    def __init__(self, name: str, params: list[torch.nn.Parameter], dp_group: GroupHandle, stage: int,
                 bucket_size: int, boundaries=(), shard_params: bool = False, offload: bool = False,
                 on_reduced=None, grad_divisor: int | None = None, zeropp: ZeroPlusPlus | None = None, *,
                 pin_params: bool, pin_optimizer: bool):
        self.name, self.params, self.dp, self.stage = name, params, dp_group, stage
        self.zeropp = zeropp or ZeroPlusPlus()  # stage 3's ZeRO++ options (megazero.zero.zeropp)
        # the reduction averages over the data-parallel replicas: dp_group's size, or (experts, reduced
        # over the expert-data-parallel group) the whole dp size, their gradients holding ep ranks' tokens
        self.grad_divisor = grad_divisor or dp_group.size
        self.shard_params = shard_params
        self.full_grads = stage <= 1
        self.offload = offload
        # host buffers page-locked if asked and CUDA exists (host_pinned): the offloaded parameter shard;
        # the offloaded master, moments and gradient staging
        self.pin_params, self.pin_optimizer = pin_params, pin_optimizer
        self.on_reduced = on_reduced  # on_reduced(group, b): bucket b's reduction has landed in grad_owned[b]
        self.shapes = [full_shape(p) for p in params]  # kept: stage 3 empties the parameters' data
        self.layout: FlatLayout = build_layout([s.numel() for s in self.shapes], dp_group.size, bucket_size,
                                               boundaries)
        self.dtype = params[0].dtype
        self.device = params[0].device
        lay = self.layout
        self.owned = [(b.start, b.end) if stage == 0 else b.shard(dp_group.rank, dp_group.size)
                      for b in lay.buckets]
        self.segments = [lay.segments_between(b, *self.owned[b.index]) for b in lay.buckets]
        self._build_params()
        self._build_grads()
        self._build_master()
        self.pending = [0] * len(lay.buckets)  # grads still expected in the current micro-batch
        self.reset_pending()
        self._bucket_grad: dict[int, torch.Tensor] = {}  # stage 2-3: bucket -> its slot (from `slots`)
        self.slots = SlotPool(self.device)
        self._gathered: dict[int, torch.Tensor] = {}  # stage 3: bucket -> its full buffer (0 bytes while released)
        self._inflight: list = []  # (work or None, bucket, temp shard or None, slot or None) not finished yet
        self._next = 0  # the bucket whose reduction is launched next: every rank launches them in index order
        self._ready: set[int] = set()  # buckets complete (every gradient arrived) and not launched yet
        self._host_grad: torch.Tensor | None = None  # offload from an accelerator: host staging for Adam
        self._secondary: dict[int, torch.Tensor] = {}  # hpZ: bucket -> this rank's 1/k of it, until the step

    # -- construction -------------------------------------------------------------------
    def _full(self, i: int) -> torch.Tensor:
        """Parameter i's full value: its data, or for one built under `megazero.zero.Init` its
        partitions all-gathered over the dp group (every rank calls this for every i, in order)."""
        p = self.params[i]
        if not is_partitioned(p):
            return p.data
        full = full_value(p, self.dp)
        p.zero_init_shape = p.zero_init_partition = None  # from here on the flat buffers hold it
        return full

    def _build_params(self) -> None:
        lay = self.layout
        if not self.shard_params:
            self.param_flat = torch.zeros(lay.total, dtype=self.dtype, device=self.device)
            for i, p in enumerate(self.params):
                s, e = lay.param_range(i)
                self.param_flat[s:e].copy_(self._full(i).reshape(-1))
                p.data = self.param_flat[s:e].view(self.shapes[i])
            self.param_owned = _flat_views(self.param_flat, self.owned)
            return
        shard = torch.zeros(lay.shard_numel, dtype=self.dtype, device="cpu" if self.offload else self.device,
                            pin_memory=self.offload and host_pinned(self.pin_params, torch.cuda.is_available()))
        self.param_owned, pos, mine = [], 0, {}  # mine: param -> [(owned view, its segment)]
        for b in lay.buckets:
            n = b.numel // self.dp.size
            view = shard[pos:pos + n]
            lo = self.owned[b.index][0]
            for seg in self.segments[b.index]:
                mine.setdefault(seg.param, []).append((view[seg.buf_start - lo:seg.buf_end - lo], seg))
            self.param_owned.append(view)
            pos += n
        for i in range(len(self.params)):  # one full parameter at a time (Init: gathered, then dropped)
            full = self._full(i).reshape(-1)  # (numel,)
            for dest, seg in mine.get(i, ()):
                dest.copy_(full[seg.param_start:seg.param_start + seg.numel])
            del full
        self.param_shard = shard
        for p in self.params:
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)

    def _build_grads(self) -> None:
        lay = self.layout
        if self.full_grads:
            self.grad_flat = torch.zeros(lay.total, dtype=torch.float32, device=self.device)
            self.grad_owned = _flat_views(self.grad_flat, self.owned)
        else:
            self.grad_shard = torch.zeros(lay.shard_numel, dtype=torch.float32, device=self.device)
            sizes = [e - s for s, e in self.owned]
            self.grad_owned = list(torch.split(self.grad_shard, sizes))

    def _build_master(self) -> None:
        sizes = [e - s for s, e in self.owned]
        self._owned_start = [sum(sizes[:b]) for b in range(len(sizes))]
        self.separate_master = self.dtype != torch.float32 or self.offload
        dev = "cpu" if self.offload else self.device
        pin = self.offload and host_pinned(self.pin_optimizer, torch.cuda.is_available())
        if self.separate_master:
            flat = torch.empty(sum(sizes), dtype=torch.float32, device=dev, pin_memory=pin)
            self.master = list(torch.split(flat, sizes))
            for m, w in zip(self.master, self.param_owned):
                m.copy_(w)
            self.master_flat = flat
        else:
            self.master = self.param_owned
        self.state_flat = torch.zeros(2, sum(sizes), dtype=torch.float32, device=dev, pin_memory=pin)
        self.exp_avg = list(torch.split(self.state_flat[0], sizes))
        self.exp_avg_sq = list(torch.split(self.state_flat[1], sizes))

    def owned_ranges(self, pred) -> list[list[tuple[int, int]]]:
        """Per bucket, the local ranges of this rank's owned slice that belong to parameters for
        which `pred(param)` holds, touching neighbours joined (one view per contiguous run)."""
        out = []
        for b, segs in enumerate(self.segments):
            lo, ranges = self.owned[b][0], []
            for s in segs:  # in buffer order
                if not pred(self.params[s.param]):
                    continue
                if ranges and ranges[-1][1] == s.buf_start - lo:
                    ranges[-1] = (ranges[-1][0], s.buf_end - lo)
                else:
                    ranges.append((s.buf_start - lo, s.buf_end - lo))
            out.append(ranges)
        return out

    # -- gradients --------------------------------------------------------------------------
    def host_grads(self, buckets) -> list[torch.Tensor]:
        """The reduced gradients of `buckets` where the optimizer runs: `grad_owned` itself, or, when
        offloaded from an accelerator, their slices of one host buffer kept for the run (copied
        asynchronously, then one synchronisation)."""
        out = [self.host_grad_async(b) for b in buckets]
        if out and self.offload and self.grad_owned[0].device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return out

    def host_grad_async(self, b: int) -> torch.Tensor:
        """Bucket b's reduced gradient on the optimizer's device: `grad_owned[b]` itself, or (offloaded
        from an accelerator) its slice of the host staging buffer with the copy enqueued on the
        current stream: the caller synchronises (or waits on an event recorded after it) before reading."""
        if not self.offload or self.grad_owned[0].device.type == "cpu":
            return self.grad_owned[b]
        if self._host_grad is None:
            self._host_grad = torch.empty(sum(t.numel() for t in self.grad_owned), dtype=torch.float32,
                                          pin_memory=host_pinned(self.pin_optimizer, torch.cuda.is_available()))
        start = self._owned_start[b]  # bucket b's offset in the concatenated owned slices
        host = self._host_grad[start:start + self.grad_owned[b].numel()]
        host.copy_(self.grad_owned[b], non_blocking=True)
        return host

    def reset_pending(self) -> None:
        for b in self.layout.buckets:
            self.pending[b.index] = sum(1 for i in b.params if self.params[i].requires_grad)

    def grad_view(self, i: int) -> torch.Tensor:
        """The fp32 slot (numel,) that parameter i's gradient accumulates into: its range of the full
        gradient buffer (stages 0-1), or of its bucket's temporary (stages 2-3, allocated zeroed by the
        bucket's first gradient). Writers add into it, then call `grad_done(i)`."""
        s, e = self.layout.param_range(i)
        if self.full_grads:
            return self.grad_flat[s:e]
        b = self.layout.bucket_of(i)
        if b < self._next:  # its reduction was launched this micro-batch: this gradient would be lost
            raise RuntimeError(f"flat group {self.name!r}: a gradient of parameter {i} arrived after its bucket {b} "
                               f"was reduced (a parameter used again after the backward of the unit holding it ended?)")
        bk = self.layout.buckets[b]
        buf = self._bucket_grad.get(b)
        if buf is None:
            buf = self._bucket_grad[b] = self.slots.take(bk.numel)
        return buf[s - bk.start:e - bk.start]

    def grad_done(self, i: int) -> int | None:
        """Parameter i's gradient of this micro-batch is in its slot; its bucket index if now complete."""
        b = self.layout.bucket_of(i)
        self.pending[b] -= 1
        return b if self.pending[b] == 0 else None

    # Every dp rank must issue the same reductions in the same order (NCCL matches collectives by
    # position on a communicator: a bucket skipped or reduced out of turn on one rank hangs the group
    # or sums different buckets together). Which buckets complete, and when, depends on the rank's
    # data when the graph does (an expert that gets no token, a conditional branch), so the order is
    # fixed instead: bucket 0, 1, 2, ... every micro-batch (stages 2-3) or step (stages 0-1), each
    # launched once its turn has come and it is complete (`bucket_ready`), the rest at `flush`.

    def bucket_ready(self, b: int, async_op: bool = False) -> None:
        """Bucket b is complete: launch, in index order, every bucket whose turn has come (b and those
        after it that are complete, once every bucket before them is launched). Communicates over
        `dp_group` (see `reduce_bucket`)."""
        if b < self._next:
            raise RuntimeError(f"flat group {self.name!r}: bucket {b} is complete again after its reduction was "
                               f"launched (bucket {self._next} is next)")
        self._ready.add(b)
        self.launch_through(b, async_op)

    def launch_through(self, b: int, async_op: bool = False, complete_or_not: bool = False) -> None:
        """Launch the reductions of buckets `_next` .. b that are ready, in index order, stopping at the
        first that is not (every bucket up to b when `complete_or_not`: an incomplete bucket is
        reduced with what it holds, an empty one as zeros)."""
        while self._next <= b and (complete_or_not or self._next in self._ready):
            self._ready.discard(self._next)
            self.reduce_bucket(self._next, async_op=async_op)

    def reduce_bucket(self, b: int, async_op: bool = False) -> None:
        """Reduce bucket b's gradient over dp (averaged): all-reduce at stage 0, else reduce-scatter
        into this rank's owned slice. Stage 2-3 add into the shard accumulator and free the bucket; a
        bucket no gradient reached on this rank is reduced as zeros (the other ranks' may hold some).
        Buckets are reduced in index order (see `bucket_ready`): b out of turn raises RuntimeError."""
        if b != self._next:
            raise RuntimeError(f"flat group {self.name!r}: bucket {b} reduced out of turn (bucket {self._next} is "
                               f"next; every dp rank reduces the buckets in index order)")
        self._next += 1
        n, bk = self.dp.size, self.layout.buckets[b]
        # A launched reduction holds memory until it is waited for (gloo's reduce-scatter: its copy of
        # the bucket, then the output shard; NCCL: its input). Finish the oldest BEFORE launching, so
        # that at most MAX_INFLIGHT are alive at any time, this one included: overlapping then costs
        # MAX_INFLIGHT - 1 reductions' memory, not one per bucket of the whole backward.
        while len(self._inflight) >= self.MAX_INFLIGHT:
            self._finish(*self._inflight.pop(0))
        if self.full_grads:
            full = self.grad_flat[bk.start:bk.end]
            full.div_(self.grad_divisor)
            if self.stage == 0:
                work = comm.all_reduce(full, self.dp, async_op=async_op, tag=f"{self.name} bucket {b}")
                self._inflight.append((work, b, None, None))
            else:
                tmp = torch.empty(bk.numel // n, dtype=torch.float32, device=self.device)
                work = comm.reduce_scatter(tmp, full, self.dp, async_op=async_op, tag=f"{self.name} bucket {b}")
                self._inflight.append((work, b, tmp, None))
        else:
            slot = self._bucket_grad.pop(b, None)
            if slot is None:  # no gradient of this bucket arrived on this rank this micro-batch
                slot = self.slots.take(bk.numel)
            slot.div_(self.grad_divisor)
            tmp = torch.empty(bk.numel // n, dtype=torch.float32, device=self.device)
            if self.zeropp.quantized_gradients:  # qgZ: int8 blocks by all-to-all (synchronous)
                quantized_reduce_scatter(tmp, slot, self.dp)
                work = None
            else:
                work = comm.reduce_scatter(tmp, slot, self.dp, async_op=async_op, tag=f"{self.name} bucket {b}")
            if comm.input_read_at_launch(work, slot):  # e.g. gloo, which copies its input at launch
                self.slots.give_back(slot)
                slot = None
            self._inflight.append((work, b, tmp, slot))
        if not async_op:
            self.wait()

    def wait(self) -> None:
        """Finish every launched reduction and place its result in `grad_owned`."""
        for entry in self._inflight:
            self._finish(*entry)
        self._inflight.clear()

    def _finish(self, work, b: int, tmp: torch.Tensor | None, slot: torch.Tensor | None) -> None:
        if isinstance(work, dist.Work):
            comm.wait(work, self.dp)  # timed (a straggler's dp peers wait here)
        elif work is not None:
            work.wait()
        if slot is not None:  # NCCL has read the bucket: its slot serves the next one
            self.slots.give_back(slot)
        if tmp is not None:
            if self.full_grads:
                self.grad_owned[b].copy_(tmp)
            else:
                self.grad_owned[b].add_(tmp)
        if self.on_reduced is not None:
            self.on_reduced(self, b)

    def flush(self, async_op: bool = False) -> None:
        """Reduce every bucket not launched yet, in index order, complete or not (end of a micro-batch's
        backward at stages 2-3, of the step's at stages 0-1), wait for every reduction, and start the
        next round at bucket 0. Communicates over `dp_group`: every bucket of the group once."""
        self.launch_through(len(self.layout.buckets) - 1, async_op, complete_or_not=True)
        self.wait()
        self._next, self._ready = 0, set()
        self.reset_pending()

    def zero_grads(self) -> None:
        """Drop this step's gradients, finishing any reduction still in flight first (a step skipped
        before its reductions, e.g. a non-finite loss, starts the next at bucket 0)."""
        self.wait()
        self._next, self._ready = 0, set()
        if self.full_grads:
            self.grad_flat.zero_()
        else:
            self.grad_shard.zero_()
            for slot in self._bucket_grad.values():
                self.slots.give_back(slot)
            self._bucket_grad.clear()
        self.reset_pending()

    # -- parameters --------------------------------------------------------------------------
    def publish_master(self, allgather_bucket_size: int) -> None:
        """Copy the updated fp32 master into the working params and, at stages 1-2, all-gather the
        updated shards over dp so every rank holds the full parameters.

        Each bucket is gathered in place: this rank's shard already sits at its offset of the bucket's
        range of `param_flat`, so `all_gather_into_tensor` writes straight into the flat buffer (no
        concatenation, no temporary, no strided copy). Gathers are launched asynchronously, with at
        most `allgather_bucket_size` elements in flight (at least one bucket); the volume is
        (Nd−1)/Nd of the buffer."""
        if self.separate_master:  # offloaded: the copies to the device asynchronous (if the master is pinned)
            for m, w in zip(self.master, self.param_owned):
                w.copy_(m, non_blocking=True)
        self.forget_secondary()  # hpZ: the parts kept were of the old parameters
        if self.stage not in (1, 2) or self.shard_params:
            return
        in_flight: list[tuple[object, int]] = []  # (work, bucket numel)
        for bk in self.layout.buckets:
            while in_flight and sum(n for _, n in in_flight) + bk.numel > allgather_bucket_size:
                work, _ = in_flight.pop(0)
                if work is not None:
                    work.wait()
            full = self.param_flat[bk.start:bk.end]  # this rank's shard is param_owned[bk.index], inside it
            in_flight.append((comm.all_gather(full, self.param_owned[bk.index], self.dp, async_op=True), bk.numel))
        for work, _ in in_flight:
            if work is not None:
                work.wait()

    def gather_bucket(self, b: int, async_op: bool = False, exact: bool = False):
        """Stage 3: all-gather bucket b's parameters over dp into the bucket's full buffer. Returns
        (work, buffer); `attach_bucket` then points the parameters at it. With ZeRO++ (`zeropp`) the
        gather is int8 (qwZ) and, once the bucket was gathered this step, over the hpZ group; `exact`
        gathers the shards as they are over dp (views that may write them back).

        Each bucket keeps one buffer for the whole run whose *storage* is freed on release (resized
        to 0 bytes) and re-grown here. Autograd keeps views of a gathered weight for backward (e.g.
        `nn.Linear` saves `weight.t()`); those views hold the storage object, not its bytes, so the
        memory is returned between forward and backward, and the re-gather before the unit's
        backward refills the very storage the saved views read (FSDP frees its buffers the same way)."""
        bk = self.layout.buckets[b]
        full = self._gathered.get(b)
        if full is None:
            full = self._gathered[b] = torch.empty(bk.numel, dtype=self.dtype, device=self.device)
        else:
            full.untyped_storage().resize_(bk.numel * full.element_size())
        hpz = None if exact else self.zeropp.hpz_group  # exact: the owned shards as they are, over dp (views)
        if hpz is not None and b in self._secondary:  # hpZ: gathered once this step, the rest stays in the node
            return comm.all_gather(full, self._secondary[b], hpz, async_op=async_op), full
        shard = self.param_owned[b].to(self.device, non_blocking=True)
        if self.zeropp.quantized_weights and not exact:  # qwZ: int8 blocks, dequantized when the gather lands
            work = quantized_all_gather(full, shard, self.dp, async_op=async_op)
        else:
            work = comm.all_gather(full, shard, self.dp, async_op=async_op, tag=f"{self.name} bucket {b}")
        if hpz is not None:
            work = after(work, lambda: self._keep_secondary(b, full))
        return work, full

    def forget_secondary(self) -> None:
        """hpZ: drop the parts kept (the parameters changed); the next gather of each bucket goes over dp."""
        self._secondary.clear()

    def _keep_secondary(self, b: int, full: torch.Tensor) -> None:
        """hpZ: keep this rank's part of gathered bucket b (part i of k for rank i of the hpZ group)."""
        k, i = self.zeropp.hpz_group.size, self.zeropp.hpz_group.rank
        part = full.numel() // k
        self._secondary[b] = full[i * part:(i + 1) * part].clone()

    def attach_bucket(self, b: int, full: torch.Tensor) -> None:
        bk = self.layout.buckets[b]
        for i in bk.params:
            s, e = self.layout.param_range(i)
            self.params[i].data = full[s - bk.start:e - bk.start].view(self.shapes[i])

    def release_bucket(self, b: int) -> None:
        """Stage 3: empty bucket b's parameters and free its gathered bytes (see `gather_bucket`)."""
        for i in self.layout.buckets[b].params:
            self.params[i].data = torch.empty(0, dtype=self.dtype, device=self.device)
        full = self._gathered.get(b)
        if full is not None:
            full.untyped_storage().resize_(0)

    # -- accounting -----------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Bytes this group holds right now, by kind."""
        def nbytes(t):
            return t.numel() * t.element_size()
        params = nbytes(self.param_shard) if self.shard_params else nbytes(self.param_flat)
        gathered = sum(t.untyped_storage().nbytes() for t in self._gathered.values())  # stage 3: held buckets
        gathered += sum(nbytes(t) for t in self._secondary.values())  # hpZ: the parts kept until the step
        grads = nbytes(self.grad_flat) if self.full_grads else nbytes(self.grad_shard)
        staging = nbytes(self._host_grad) if self._host_grad is not None else 0  # offload from an accelerator
        return {"params": params + gathered, "grads": grads,
                "master": nbytes(self.master_flat) if self.separate_master else 0,
                "optimizer_states": nbytes(self.state_flat), "comm_buffers": staging,
                "grad_buckets": self.slots.nbytes()}  # the bucket slots, kept for the run
