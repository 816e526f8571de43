"""Typed collectives and point-to-point ops over an explicit group, with byte counting.

Every function takes a `GroupHandle` (built by `ParallelContext`) and records, in the handle's
`CommStats`, one call plus the elements and bytes this rank moves under the ring algorithm:

| op             | elements moved per rank (n = group size)      |
|----------------|-----------------------------------------------|
| all_reduce     | 2·(n−1)/n · numel                             |
| reduce_scatter | (n−1)/n · numel(input)   = (n−1)·numel(shard) |
| all_gather     | (n−1)/n · numel(output)  = (n−1)·numel(shard) |
| reduce         | (n−1)/n · numel                               |
| broadcast      | (n−1)/n · numel                               |
| scatter/gather | (n−1)/n · numel(full)                         |
| send, recv     | numel                                         |
| all_to_all     | numel(input) − the rows a rank keeps          |

These are the figures docs/reference.md states (plain DP 2Ψ, ZeRO-3 3Ψ, TP 8·b·s·h·(t−1)/t),
so tests and benchmarks can check volumes exactly. Groups of one rank are no-ops and record nothing.

A group that knows which node each member is on (`GroupHandle.nodes`) also counts what leaves the
node: in a ring, a rank sends to the next group rank, so its figure crosses nodes when that rank is
on another node (a ring of n ranks over N nodes, node-major, has N such edges); point-to-point
crosses when the peer is elsewhere; an all-to-all sends its rows for other nodes' ranks across.
A group with a `hierarchy` (`megazero.runtime.hierarchical`) runs all_reduce, reduce_scatter and
all_gather in two levels, inside each node and then between nodes; the steps are counted on the
hierarchy's own groups (axes ``<axis>.intra`` and ``<axis>.inter``).

A group with an `order` check (`megazero.runtime.order_check`, `comm.verify_order`) posts every
operation to it before issuing it, so members that would issue different collectives, or the same
ones in another order, stop with one error instead of hanging or summing the wrong buffers on NCCL.

The handle's `CommStats` also keeps, per axis, the host seconds this rank spent inside synchronous calls
(`CommStats.waits`): what the trainer's straggler watch subtracts from a step to get the rank's own
compute (`megazero.resilience.stragglers`).

Point-to-point uses blocking `send`/`recv` (or single `isend`/`irecv`) on gloo, never
`batch_isend_irecv`, which can hang there (pytorch#132644). `batch_isend_irecv` is for NCCL
(`backend` tells a group's backend): it counts each of its sends and receives as `send` and `recv`
do, so the volumes are the same whichever path moved them.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "avg": getattr(dist.ReduceOp, "AVG", None)}  # AVG is missing from older torch builds


@dataclass
class OpCount:
    """Totals for one (axis, op): calls, elements and bytes moved by this rank."""

    calls: int = 0
    elements: float = 0.0
    bytes: float = 0.0

    def __iadd__(self, other: "OpCount") -> "OpCount":
        self.calls += other.calls
        self.elements += other.elements
        self.bytes += other.bytes
        return self


@dataclass
class CommStats:
    """Per (axis, op) counters of this rank's communication, and of the part of it that leaves the
    rank's node (`inter_node`). Thread-safe (backward hooks may record from autograd threads)."""

    counts: dict = field(default_factory=dict)
    inter_node: dict = field(default_factory=dict)
    waits: dict = field(default_factory=dict)  # axis -> host seconds blocked in synchronous calls (`blocked`)
    fingerprints: list | None = None  # while a list: (direction, axis, checksum) of every tensor sent and received
    timed: dict = field(default_factory=dict)  # (axis, op, message bytes) -> [calls, seconds]: calls timed whole
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_wait(self, axis: str, seconds: float) -> None:
        """`seconds` this rank's host spent inside a synchronous call on `axis` (transfer and waiting for peers)."""
        with self._lock:
            self.waits[axis] = self.waits.get(axis, 0.0) + seconds

    def wait_seconds(self) -> dict[str, float]:
        """A copy of the blocked seconds by axis, since the start."""
        with self._lock:
            return dict(self.waits)

    def record(self, axis: str, op: str, elements: float, element_size: int, inter_elements: float = 0.0) -> None:
        """One call moving `elements` of `element_size` bytes, `inter_elements` of them to other nodes."""
        with self._lock:
            c = self.counts.setdefault((axis, op), OpCount())
            c.calls += 1
            c.elements += elements
            c.bytes += elements * element_size
            x = self.inter_node.setdefault((axis, op), OpCount())
            x.calls += 1 if inter_elements else 0
            x.elements += inter_elements
            x.bytes += inter_elements * element_size

    def record_time(self, axis: str, op: str, nbytes: int, seconds: float) -> None:
        """One call of `op` on `axis` with a message of `nbytes`, timed whole by its caller (device waited for
        before and after): DeepSpeed's comms logger's records (`megazero.comm`'s calls when it profiles them)."""
        with self._lock:
            row = self.timed.setdefault((axis, op, nbytes), [0, 0.0])
            row[0] += 1
            row[1] += seconds

    def timings(self) -> dict[tuple[str, str, int], tuple[int, float]]:
        """A copy of the timed calls: (axis, op, message bytes) -> (calls, seconds)."""
        with self._lock:
            return {k: (v[0], v[1]) for k, v in self.timed.items()}

    def total(self, axis: str | None = None, op: str | None = None, inter_node: bool = False) -> OpCount:
        """Sum over entries matching `axis` and `op` (None matches all); with `inter_node`, only what
        left the node."""
        out = OpCount()
        with self._lock:
            for (a, o), c in (self.inter_node if inter_node else self.counts).items():
                if (axis is None or a == axis) and (op is None or o == op):
                    out += c
        return out

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()
            self.inter_node.clear()
            self.waits.clear()
            self.timed.clear()

    def snapshot(self) -> dict[str, dict[str, float]]:
        """A JSON-ready copy: {"axis/op": {"calls", "elements", "bytes", "inter_node_bytes"}}."""
        with self._lock:
            return {f"{a}/{o}": {"calls": c.calls, "elements": c.elements, "bytes": c.bytes,
                                 "inter_node_bytes": self.inter_node.get((a, o), OpCount()).bytes}
                    for (a, o), c in sorted(self.counts.items())}


@dataclass(frozen=True, eq=False)
class GroupHandle:
    """A process group with its facts: axis name, member global ranks, this rank's index.

    `pg` is None when the group has one member (or this rank is not a member). `nodes`: the node of
    each member (None: unknown, counted as one node); `hierarchy`: the two-level form of this group's
    all_reduce, reduce_scatter and all_gather (`megazero.runtime.hierarchical.Hierarchy`), or None;
    `order`: the order check every operation on this group posts to before it is issued
    (`megazero.runtime.order_check.OrderCheck`), or None (off).
    """

    axis: str
    ranks: tuple[int, ...]
    rank: int
    pg: object | None
    stats: CommStats
    timeout_s: float = 300.0
    nodes: tuple[int, ...] | None = None
    hierarchy: object | None = None
    order: object | None = None

    def crosses(self, group_rank: int) -> bool:
        """Whether traffic from this rank to member `group_rank` leaves the node."""
        return self.nodes is not None and self.nodes[group_rank] != self.nodes[self.rank]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def __repr__(self) -> str:
        return f"GroupHandle({self.axis}, ranks={list(self.ranks)}, rank={self.rank})"


class Pending:
    """Work handles of one logical collective made of several, and what to do once they land (`finish`,
    run once at the first `wait`); `Pending([])` is one that has completed."""

    def __init__(self, works, finish=None):
        self.works, self.finish = [w for w in works if w is not None], finish

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            w.wait()
        self.works = []
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()
        return True


def after(work, finish):
    """`finish()` once `work` (a handle, or None: already done) has landed: now, or at its wait."""
    if work is None:
        finish()
        return None
    return Pending([work], finish)


def input_read_at_launch(work, input: torch.Tensor) -> bool:
    """Whether an asynchronous collective has finished reading `input` when its launch returns, so the
    caller may reuse that memory before waiting: yes when it completed (None, or a `Pending` with no
    work left) and for gloo's CPU collectives, which copy their input when launched; no on NCCL (it
    reads the input until the work completes) and for a hierarchical chain (it runs later, on its
    worker thread). Local: no communication."""
    if work is None or (isinstance(work, Pending) and not work.works and work.finish is None):
        return True
    return input.device.type == "cpu" and isinstance(work, dist.Work)


def single_rank_group(axis: str = "world", stats: CommStats | None = None) -> GroupHandle:
    """A trivial group of this process alone: every op is a local no-op. For single-process runs."""
    return GroupHandle(axis, (0,), 0, None, stats or CommStats())


def world_group(stats: CommStats | None = None) -> GroupHandle:
    """Every rank of the default process group (a single-rank group when there is none): for code
    that runs before a ParallelContext exists, such as `megazero.zero.Init`."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return single_rank_group("world", stats)
    world = dist.get_world_size()
    return GroupHandle("world", tuple(range(world)), dist.get_rank(), dist.group.WORLD, stats or CommStats())


def _op(name: str):
    op = _REDUCE_OPS.get(name)
    if op is None:
        raise ValueError(f"reduce op {name!r} is not supported; valid: sum, max, min")
    return op


def _verify(group: GroupHandle, kind: str, t: torch.Tensor | None = None, sized: bool = True,
            extra: str = "", tag: str | None = None) -> None:
    """Post this collective to the group's order check (when on): every member must issue the same
    `kind` on the same dtype and element count (not `sized`: counts may differ, an all-to-all's) and
    `extra` (op, root, `tag`) at the same position."""
    if group.order is None:
        return
    what = "" if t is None else f"{t.dtype} x{t.numel()}" if sized else str(t.dtype)
    group.order.collective(group, kind, " ".join(x for x in (what, extra, f"[{tag}]" if tag else "") if x),
                           () if t is None else (t,))


def _verify_p2p(group: GroupHandle, kind: str, t: torch.Tensor, peer: int) -> None:
    """Post a send to / receive from group rank `peer` to the order check: matched with the peer's
    receive / send in order, on dtype and shape."""
    if group.order is not None:
        group.order.p2p(group, kind, peer, f"{t.dtype} {tuple(t.shape)}", (t,))


def _record(group: GroupHandle, op: str, elements: float, t: torch.Tensor, peer: int | None = None) -> None:
    """Count one call; its elements cross nodes when `peer` (default: the next rank of the ring) is
    on another node."""
    peer = (group.rank + 1) % group.size if peer is None else peer
    group.stats.record(group.axis, op, elements, t.element_size(), elements if group.crosses(peer) else 0.0)


def checksum(t: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 on `t`'s device that changes with any single bit of `t`: the sum of its bytes read as int32
    words (as bytes when their count or address is not a multiple of 4). No host synchronisation."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    aligned = flat.numel() % 4 == 0 and flat.data_ptr() % 4 == 0
    return (flat.view(torch.int32) if aligned else flat).to(torch.int64).sum()


def wait(work, group: GroupHandle, received: torch.Tensor | None = None) -> None:
    """Wait for an asynchronous operation's `work` (None: done) launched over `group`: its host seconds go to
    the group's `CommStats.waits` as a synchronous call's do, and `received` (what it filled) is `note`d."""
    if work is not None:
        start = time.perf_counter()
        work.wait()
        group.stats.add_wait(group.axis, time.perf_counter() - start)
    note(group, "in", received)


def note(group: GroupHandle, direction: str, t: torch.Tensor | None) -> None:
    """While the group's stats record fingerprints (the silent-error check, `megazero.resilience.silent_check`):
    append (`direction` "out" or "in", axis, `checksum(t)`). Callers that wait for an asynchronous
    collective note what it received ("in") when they wait."""
    rec = group.stats.fingerprints
    if rec is not None and t is not None:
        rec.append((direction, group.axis, checksum(t)))


def _blocked(group: GroupHandle, async_op: bool, call, sent: torch.Tensor | None = None,
             received: torch.Tensor | None = None):
    """Run `call` (the torch.distributed op); a synchronous one's host seconds go to the group's
    `CommStats.waits` (on gloo the transfer and the wait for the slowest peer; on NCCL only the launch: the
    device waits instead). An asynchronous one returns its handle untimed. `sent` (before the call) and, when
    synchronous, `received` (after it) are `note`d."""
    note(group, "out", sent)
    if async_op:
        return call()
    start = time.perf_counter()
    try:
        return call()
    finally:
        group.stats.add_wait(group.axis, time.perf_counter() - start)
        note(group, "in", received)


def all_reduce(tensor: torch.Tensor, group: GroupHandle, op: str = "sum", async_op: bool = False,
               tag: str | None = None):
    """All-reduce `tensor` in place over `group` (in two levels when the group has a hierarchy).
    `tag` (e.g. "bucket 3") tells the order check this call from others of the same size."""
    n = group.size
    if n == 1:
        return None
    _verify(group, "all_reduce", tensor, extra=op, tag=tag)
    if group.hierarchy is not None and op == "sum":
        return group.hierarchy.all_reduce(tensor, async_op)
    _record(group, "all_reduce", 2 * (n - 1) / n * tensor.numel(), tensor)
    return _blocked(group, async_op, lambda: dist.all_reduce(tensor, op=_op(op), group=group.pg, async_op=async_op),
                    tensor, tensor)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: GroupHandle, op: str = "sum",
                   async_op: bool = False, tag: str | None = None):
    """Reduce `input` (numel = n·numel(output)) over `group`; rank i keeps reduced shard i in `output`."""
    n = group.size
    if input.numel() != n * output.numel():
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected "
                         f"{n}·{output.numel()} for a group of {n}")
    if n == 1:
        output.copy_(input.view_as(output))
        return None
    _verify(group, "reduce_scatter", input, extra=op, tag=tag)
    if group.hierarchy is not None and op == "sum":
        return group.hierarchy.reduce_scatter(output, input, async_op)
    _record(group, "reduce_scatter", (n - 1) * output.numel(), output)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return _blocked(group, async_op, lambda: fn(output, input, op=_op(op), group=group.pg, async_op=async_op),
                    input, output)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: GroupHandle, async_op: bool = False,
               tag: str | None = None):
    """Gather every rank's `input` over `group` into `output` (numel = n·numel(input)), rank order."""
    n = group.size
    if output.numel() != n * input.numel():
        raise ValueError(f"all_gather: output has {output.numel()} elements, expected "
                         f"{n}·{input.numel()} for a group of {n}")
    if n == 1:
        output.view_as(input).copy_(input)
        return None
    _verify(group, "all_gather", input, tag=tag)
    if group.hierarchy is not None:
        return group.hierarchy.all_gather(output, input, async_op)
    _record(group, "all_gather", (n - 1) * input.numel(), input)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return _blocked(group, async_op, lambda: fn(output, input, group=group.pg, async_op=async_op), input, output)


def broadcast(tensor: torch.Tensor, src: int, group: GroupHandle, async_op: bool = False, tag: str | None = None):
    """Broadcast `tensor` from group rank `src` to every member of `group`."""
    n = group.size
    if n == 1:
        return None
    _verify(group, "broadcast", tensor, extra=f"from {src}", tag=tag)
    _record(group, "broadcast", (n - 1) / n * tensor.numel(), tensor)
    return _blocked(group, async_op,
                    lambda: dist.broadcast(tensor, src=group.global_rank(src), group=group.pg, async_op=async_op),
                    tensor if group.rank == src else None, None if group.rank == src else tensor)


def reduce(tensor: torch.Tensor, dst: int, group: GroupHandle, op: str = "sum", async_op: bool = False):
    """Reduce `tensor` over `group` into group rank `dst` (other ranks' buffers are undefined after)."""
    n = group.size
    if n == 1:
        return None
    _verify(group, "reduce", tensor, extra=f"{op} to {dst}")
    _record(group, "reduce", (n - 1) / n * tensor.numel(), tensor)
    return _blocked(group, async_op, lambda: dist.reduce(tensor, dst=group.global_rank(dst), op=_op(op),
                                                         group=group.pg, async_op=async_op),
                    tensor, tensor if group.rank == dst else None)


def scatter(output: torch.Tensor, inputs: list[torch.Tensor] | None, src: int, group: GroupHandle):
    """Group rank `src` sends `inputs[i]` to group rank i; every rank receives into `output`."""
    n = group.size
    if n == 1:
        output.copy_(inputs[0])
        return None
    _verify(group, "scatter", output, extra=f"from {src}")
    _record(group, "scatter", (n - 1) * output.numel(), output)
    return _blocked(group, False, lambda: dist.scatter(output, inputs if group.rank == src else None,
                                                       src=group.global_rank(src), group=group.pg))


def gather(input: torch.Tensor, outputs: list[torch.Tensor] | None, dst: int, group: GroupHandle):
    """Every rank sends `input` to group rank `dst`, which receives them into `outputs`."""
    n = group.size
    if n == 1:
        outputs[0].copy_(input)
        return None
    _verify(group, "gather", input, extra=f"to {dst}")
    _record(group, "gather", (n - 1) * input.numel(), input)
    return _blocked(group, False, lambda: dist.gather(input, outputs if group.rank == dst else None,
                                                      dst=group.global_rank(dst), group=group.pg))


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group: GroupHandle,
                      output_splits: Sequence[int] | None = None, input_splits: Sequence[int] | None = None):
    """Every rank sends rows ``input_splits[j]`` of `input` (dim 0, in rank order) to group rank j and
    receives ``output_splits[j]`` rows from it into `output` (equal splits when None). Records the
    elements this rank sends to the others (its own slice stays): numel(input) − its own rows."""
    n = group.size
    if n == 1:
        output.copy_(input)
        return None
    rows = input.shape[0]
    splits = list(input_splits) if input_splits is not None else [rows // n] * n
    width = input.numel() // rows if rows else 0
    _verify(group, "all_to_all", input, sized=False, extra=f"rows of {tuple(input.shape[1:])}")
    away = sum(splits[j] for j in range(n) if group.crosses(j))  # rows for other nodes' ranks
    group.stats.record(group.axis, "all_to_all", (rows - splits[group.rank]) * width, input.element_size(),
                       away * width)
    return _blocked(group, False, lambda: dist.all_to_all_single(
        output, input, None if output_splits is None else list(output_splits),
        None if input_splits is None else list(input_splits), group=group.pg), input, output)


def send(tensor: torch.Tensor, dst: int, group: GroupHandle) -> None:
    """Blocking send of `tensor` to group rank `dst`."""
    _verify_p2p(group, "send", tensor, dst)
    _record(group, "send", tensor.numel(), tensor, peer=dst)
    _blocked(group, False, lambda: dist.send(tensor.contiguous(), dst=group.global_rank(dst), group=group.pg),
             tensor)


def recv(tensor: torch.Tensor, src: int, group: GroupHandle) -> None:
    """Blocking receive into `tensor` from group rank `src`."""
    _verify_p2p(group, "recv", tensor, src)
    _record(group, "recv", tensor.numel(), tensor, peer=src)
    _blocked(group, False, lambda: dist.recv(tensor, src=group.global_rank(src), group=group.pg),
             None, tensor)


def isend(tensor: torch.Tensor, dst: int, group: GroupHandle):
    """Non-blocking single send to group rank `dst`; returns the work handle."""
    _verify_p2p(group, "send", tensor, dst)
    _record(group, "send", tensor.numel(), tensor, peer=dst)
    note(group, "out", tensor)
    return dist.isend(tensor, dst=group.global_rank(dst), group=group.pg)


def irecv(tensor: torch.Tensor, src: int, group: GroupHandle):
    """Non-blocking single receive from group rank `src`; returns the work handle."""
    _verify_p2p(group, "recv", tensor, src)
    _record(group, "recv", tensor.numel(), tensor, peer=src)
    return dist.irecv(tensor, src=group.global_rank(src), group=group.pg)


@dataclass(frozen=True)
class PeerOp:
    """One side of a point-to-point transfer in a `batch_isend_irecv`: `kind` "send" of `tensor` to
    group rank `peer`, or "recv" into `tensor` from it."""

    kind: str
    tensor: torch.Tensor
    peer: int

    def __post_init__(self):
        if self.kind not in ("send", "recv"):
            raise ValueError(f"PeerOp kind {self.kind!r}: must be 'send' or 'recv'")


def batch_isend_irecv(ops: Sequence[PeerOp], group: GroupHandle) -> list:
    """Post every op of `ops` (sends and receives with members of `group`) as one batch (NCCL: one
    group call) and return the work handles; wait on all of them before reading a receive buffer or
    reusing a sent tensor. Ops between the same pair of ranks in the same direction pair up in list
    order. Each op is counted as `send`/`recv` counts it. NCCL only: on gloo this can hang
    (pytorch#132644), use `send`/`recv` there."""
    if not ops:
        return []
    p2p_ops = []
    for op in ops:
        _verify_p2p(group, op.kind, op.tensor, op.peer)
        _record(group, op.kind, op.tensor.numel(), op.tensor, peer=op.peer)
        if op.kind == "send":
            note(group, "out", op.tensor)  # the receives are noted by whoever waits (`wait`)
        fn, tensor = (dist.isend, op.tensor.contiguous()) if op.kind == "send" else (dist.irecv, op.tensor)
        p2p_ops.append(dist.P2POp(fn, tensor, group.global_rank(op.peer), group.pg))
    return dist.batch_isend_irecv(p2p_ops)


def backend(group: GroupHandle, device: torch.device | str = "cpu") -> str | None:
    """The name of the backend ("gloo", "nccl", ...) that carries `group`'s traffic on `device`'s
    type; None for a group without a process group (one rank). A process group with a backend per
    device type ("cpu:gloo,cuda:nccl") answers the one for `device`."""
    if group.pg is None:
        return None
    name = str(dist.get_backend(group.pg))
    return backend_for_device(name, torch.device(device).type)


def backend_for_device(name: str, device_type: str) -> str | None:
    """The backend of `device_type` in a process group's backend string: "nccl" is every device's,
    "cpu:gloo,cuda:nccl" names one per device type (None when `device_type` has none)."""
    if ":" not in name:
        return name
    per_device = dict(part.split(":", 1) for part in name.split(","))
    return per_device.get(device_type)


def all_gather_object(obj, group: GroupHandle) -> list:
    """Every member's picklable `obj`, in group rank order (not counted: metadata, not tensors)."""
    if group.size == 1:
        return [obj]
    _verify(group, "all_gather_object")
    out = [None] * group.size
    dist.all_gather_object(out, obj, group=group.pg)
    return out


def barrier(group: GroupHandle) -> None:
    """Wait until every member of `group` reaches this point (not counted)."""
    if group.size > 1:
        _verify(group, "barrier")
        dist.barrier(group=group.pg)
