"""ZeRO-Offload's CPU Adam overlapped with the rest of backward (what DeepSpeed#6834 asks for).

With the optimizer offloaded, the step's CPU Adam normally starts after the whole backward, and the
accelerator waits for it. When the update of one bucket depends on nothing but that bucket's reduced
gradient, it can run as soon as the bucket's last reduction lands, on the host, while backward
computes the buckets before it (backward fills them in reverse layer order). That holds when nothing
global scales or vetoes the step: no gradient clipping (it needs the global norm), no loss scale and
no inf/NaN check (``nonfinite_gradients=ignore``); the optimizer enables this only then, and only
with ``overlap_comm`` (the reductions are asynchronous already).

`EarlyUpdates` receives every finished bucket reduction of the step's last micro-batch
(`FlatGroup`'s ``on_reduced``), enqueues the bucket's host copy (asynchronous from an accelerator) and
hands the bucket's update to one worker thread (the C++ CPU Adam releases the GIL). `ZeroOptimizer.step`
waits for the worker (`finish`) and updates the buckets it did not take the usual way, then publishes
the parameters. The result is bit for bit the same as updating after backward: the same kernel on the
same values, one bucket per call (a multi-tensor call equals one call per tensor bit for bit).

Not taken early: tied embedding/head buckets (summed over the embedding group at the step) and, with
TP > 1, buckets holding sequence-parallel parameters (summed over the TP group at the step). The
working parameters are untouched until the step publishes: an offloaded master is always separate.
No communication.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch


class EarlyUpdates:
    """The per-bucket updates of one `ZeroOptimizer` (`opt`) run during the last backward of a step."""

    def __init__(self, opt, sp_ranges):
        self.opt = opt
        tp = opt.pctx.tp_size
        self.eligible = {(g, b) for g, group in enumerate(opt.groups) if group.name != "tied"
                         for b in range(len(group.layout.buckets)) if tp == 1 or not sp_ranges[g][b]}
        for group in opt.groups:
            if not group.separate_master:
                raise AssertionError(f"early updates need a separate master (group {group.name})")
        self._index = {id(group): g for g, group in enumerate(opt.groups)}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megazero-cpu-adam")
        self._futures: dict[tuple[int, int], Future] = {}

    def bucket_reduced(self, group, b: int) -> None:
        """Bucket b of `group` holds its reduced gradient: at the step's last micro-batch, start its
        update (the step it updates for is the coming one)."""
        g = self._index[id(group)]
        if not self.opt.last_microbatch or (g, b) not in self.eligible or (g, b) in self._futures:
            return
        host = group.host_grad_async(b)
        ready = None
        if host.device != group.grad_owned[b].device:  # the copy must land before the worker reads it
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(group.grad_owned[b].device))
        step = self.opt.step_count + 1
        self._futures[(g, b)] = self._pool.submit(self._update, group, g, b, host, ready, step)

    def _update(self, group, g: int, b: int, host: torch.Tensor, ready, step: int) -> None:
        if ready is not None:
            ready.synchronize()
        self.opt._update_group(group, self.opt._runs[g], 1.0, [b], {b: host}, step)

    def finish(self) -> set[tuple[int, int]]:
        """Wait for every update started this step (re-raising a worker's error); the (group index,
        bucket) pairs they updated."""
        done = set(self._futures)
        try:
            for future in self._futures.values():
                future.result()
        finally:
            self._futures.clear()
        return done

    def pending(self) -> int:
        """Updates started this step and not yet collected by `finish`."""
        return len(self._futures)
