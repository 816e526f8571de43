"""Two-level collectives: inside each node first, then between nodes.

A group of n = N·k ranks spread k per node over N nodes (node-major: group rank g = j·k + i is the
i-th of node j's members) gets a `Hierarchy` of two groups per rank: ``intra``, the k members on
its node, and ``inter``, the N members with its local index i, one per node. Then, for T elements:

* all_reduce: reduce-scatter inside the node (each local rank keeps T/k), all-reduce that slice
  between nodes, all-gather inside the node. A flat ring over the n ranks crosses nodes on N of its
  edges, each carrying 2(n−1)/n·T: N·2(n−1)/n·T leave the nodes; the two-level form sends only the
  k inter-node rings' 2(N−1)/N·T/k per rank across, k·N·2(N−1)/N·T/k = 2(N−1)·T in all. The ratio
  is N(n−1) / (n(N−1)) = (N·k − 1) / (k(N−1)): 1.75 for 2 nodes of 4 ranks, 1.875 for 2 of 8.
* reduce_scatter (input n·S, group rank g keeps shard g): the input is reordered from (node j,
  local i) to (local i, node j) blocks, reduce-scattered inside the node (local i keeps the N blocks
  of index i), then between nodes (node j keeps block (j, i) = shard g). Crossing: (N−1)·T in all
  instead of N·(n−1)/n·T, the same ratio.
* all_gather: the inverse: between nodes (blocks (j, i) for every j), inside the node, reordered back.

Sums happen in another order than the flat ring's, so results agree to rounding (fp32: ~1e-7
relative), not bit for bit. The steps are counted on ``intra`` and ``inter``'s axes.

The three steps depend on each other, so an asynchronous caller (`async_op`: ZeRO's bucket reductions
under overlap_comm, stage 3's prefetching gathers) gets them run by the hierarchy's one worker thread
(`Chain`), in the order they were launched (the same on every rank: the two groups see the same
sequence everywhere), while the caller's thread goes on; on a GPU the chain runs on a side stream that
first waits for the caller's stream, and `wait()` makes the caller's stream wait for the chain's end.
Synchronous calls run in the caller's thread, after whatever the worker still has queued.
"""
from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field

import torch

from megazero.runtime import comm
from megazero.runtime.comm import GroupHandle


def node_split(ranks: list[int] | tuple[int, ...], ranks_per_node: int) -> tuple[list[list[int]], list[list[int]]] | None:
    """The intra-node groups (each node's members of `ranks`, in order) and inter-node groups (the i-th
    member of every node) of a group, or None when the nodes do not hold the same number of its members
    (then only the flat form applies). Node of a global rank: rank // ranks_per_node."""
    by_node: dict[int, list[int]] = {}
    for r in ranks:
        by_node.setdefault(r // ranks_per_node, []).append(r)
    sizes = {len(v) for v in by_node.values()}
    if len(sizes) != 1:
        return None
    intra = list(by_node.values())
    inter = [[members[i] for members in intra] for i in range(len(intra[0]))]
    return intra, inter


class ChainWork:
    """The handle of a chain run by a `Chain`: `wait()` blocks until it has run (re-raising its error)
    and, on a GPU, orders the caller's stream after it."""

    def __init__(self, future: concurrent.futures.Future, done_event=None):
        self.future, self.done_event = future, done_event

    def is_completed(self) -> bool:
        return self.future.done()

    def wait(self, timeout=None) -> bool:
        self.future.result()
        if self.done_event is not None:
            torch.cuda.current_stream().wait_event(self.done_event)
        return True


class Chain:
    """One worker thread (started on first use) that runs dependent collectives in launch order."""

    def __init__(self):
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._stream = None
        self._lock = threading.Lock()

    def submit(self, fn, device: torch.device) -> ChainWork:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megazero-hierarchical")
        if device.type != "cuda":
            return ChainWork(self._pool.submit(fn))
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        ready, done = torch.cuda.Event(), torch.cuda.Event()
        ready.record()  # the caller's stream: the inputs are written

        def on_side_stream():
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                fn()
                done.record(self._stream)

        return ChainWork(self._pool.submit(on_side_stream), done)

    def drain(self) -> None:
        """Wait for everything queued (a synchronous call runs after it)."""
        if self._pool is not None:
            self._pool.submit(lambda: None).result()


@dataclass(frozen=True, eq=False)
class Hierarchy:
    """This rank's two levels of a group: `intra` (its node's members, in group order) and `inter`
    (one member per node, this rank's local index). `chain`: the worker of its asynchronous calls."""

    intra: GroupHandle
    inter: GroupHandle
    chain: Chain = field(default_factory=Chain)

    def _run(self, fn, device: torch.device, async_op: bool):
        if async_op:
            return self.chain.submit(fn, device)
        self.chain.drain()
        fn()
        return comm.Pending([])

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        """Sum `tensor` in place over the whole group: reduce-scatter over `intra`, all-reduce over
        `inter`, all-gather over `intra`. Returns a handle (complete unless `async_op`)."""
        return self._run(lambda: self._all_reduce(tensor), tensor.device, async_op)

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        k = self.intra.size
        flat = tensor.view(-1)
        pad = (-flat.numel()) % k
        work = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat.clone()  # (k·c,)
        piece = work.new_empty(work.numel() // k)
        comm.reduce_scatter(piece, work, self.intra)
        comm.all_reduce(piece, self.inter)
        comm.all_gather(work, piece, self.intra)
        flat.copy_(work[:flat.numel()])

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Sum `input` (n·S elements, S = numel(output)) over the group; group rank j·k + i keeps shard
        j·k + i in `output`. Returns a handle (complete unless `async_op`)."""
        return self._run(lambda: self._reduce_scatter(output, input), input.device, async_op)

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        k, N = self.intra.size, self.inter.size
        s = output.numel()
        by_local = input.reshape(N, k, s).transpose(0, 1).contiguous()  # (k, N, S): local i's blocks together
        mine = output.new_empty(N * s)
        comm.reduce_scatter(mine, by_local.view(-1), self.intra)  # (N·S,): blocks (·, i)
        comm.reduce_scatter(output.view(-1), mine, self.inter)  # block (j, i)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Every member's `input` (S elements) into `output` (n·S, group order). Returns a handle
        (complete unless `async_op`)."""
        return self._run(lambda: self._all_gather(output, input), input.device, async_op)

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        k, N = self.intra.size, self.inter.size
        s = input.numel()
        mine = input.new_empty(N * s)
        comm.all_gather(mine, input.reshape(-1), self.inter)  # (N·S,): blocks (j, i) for every node j
        by_local = input.new_empty(k * N * s)
        comm.all_gather(by_local, mine, self.intra)  # (k, N, S)
        output.view(N, k, s).copy_(by_local.view(k, N, s).transpose(0, 1))  # back to group order (N, k, S)


__all__ = ["Chain", "ChainWork", "Hierarchy", "node_split"]
