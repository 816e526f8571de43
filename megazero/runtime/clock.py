"""Timestamps of device work: host clock on CPU, CUDA events on GPU.

On a GPU a kernel launch returns before the kernel runs, so `time.perf_counter()` around an
instruction measures its launch, not its work. `DeviceClock.mark()` returns a token that becomes a
time in seconds with `resolve()`: on CPU the token already is one (the host clock, work is
synchronous); on CUDA it is an event recorded on the current stream, and `resolve` synchronises once
and converts every event to host seconds through one reference pair (an event and the host time,
taken together after a synchronisation, renewed after every resolve). No communication.
"""
from __future__ import annotations

import time

import torch


class DeviceClock:
    """Marks and resolves timestamps of work on `device` (see the module docstring)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.deferred = self.device.type == "cuda"  # tokens need `resolve` before they are times
        self._origin: tuple[object, float] | None = None  # (CUDA event, host seconds) recorded together

    def mark(self):
        """A token for 'now' in the device's stream order."""
        if not self.deferred:
            return time.perf_counter()
        if self._origin is None:
            torch.cuda.synchronize(self.device)
            origin = torch.cuda.Event(enable_timing=True)
            origin.record(torch.cuda.current_stream(self.device))
            self._origin = (origin, time.perf_counter())
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def resolve(self, tokens: list) -> list[float]:
        """Host-clock seconds of `tokens` (one synchronisation on CUDA, none on CPU)."""
        if not self.deferred:
            return list(tokens)
        if not tokens:
            return []
        torch.cuda.synchronize(self.device)
        origin, host = self._origin
        self._origin = None  # the next mark re-anchors: elapsed_time is float32 ms, precise over one step only
        return [host + origin.elapsed_time(t) / 1e3 for t in tokens]
