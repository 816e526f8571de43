"""A step that stops making progress ends every rank with the schedule position, on NCCL too.

On gloo a collective or p2p wait that cannot complete raises after the group's timeout, and the
pipeline executor re-raises it as a `PipelineError` naming the stage, rank and instruction. On NCCL
`work.wait()` does not block the host: it only orders the compute stream after the communication. A
peer that died or diverged leaves a kernel waiting on the GPU; the host runs on until it needs a value
(the loss, the norm) and blocks there, and NCCL's watchdog ends the process at the timeout with its own
message, which does not say where in the schedule the rank was.

`StallWatch` keeps megazero's own record: the executor calls `note(where)` before every instruction
(a string such as "stage 2 (rank 5) at RecvGrad mb 7 from stage 3 (instruction 41 of 96)"). A daemon
thread checks, while the watch is armed (inside a training step), that a note came in the last
`limit_s` seconds. If none did, it prints the last position and how long it has waited to stderr,
asks NCCL's flight recorder for its record of this rank's collectives (written next to the message,
when torch has one), and ends the process with exit code 72, so that every rank stuck behind the
failure ends too and says where. The limit is chosen below NCCL's timeout (`limit_for`), so megazero
speaks first; on gloo it is above the group timeout, so gloo's own error (and the `PipelineError`)
comes first and the watch is only a backstop. No communication.
"""
from __future__ import annotations

import os
import sys
import threading
import time

EXIT_CODE = 72


def limit_for(backend: str | None, timeout_s: float) -> float:
    """Seconds without progress before the watch fires: before NCCL's watchdog (at `timeout_s`) on
    NCCL, after gloo's own timeout error otherwise."""
    if backend == "nccl":
        return max(1.0, min(0.9 * timeout_s, timeout_s - 10.0))
    return timeout_s + 30.0


class StallWatch:
    """See the module docstring. `rank`: this process' global rank (in the message); `trace_dir`: where
    the flight recorder's record goes (None: the working directory); `exit` (tests): what ends the
    process, called with the exit code after the message."""

    def __init__(self, limit_s: float, rank: int, trace_dir: str | None = None, exit=os._exit, poll_s: float = 1.0):
        self.limit_s, self.rank, self.trace_dir = limit_s, rank, trace_dir
        self._exit, self._poll = exit, min(poll_s, limit_s / 4)
        self._where, self._last = "before the first instruction", time.monotonic()
        self._armed = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.fired: str | None = None

    def note(self, where: str) -> None:
        """This rank is about to run `where`: progress."""
        self._where, self._last = where, time.monotonic()

    def arm(self) -> None:
        """Inside a step: silence for `limit_s` seconds is a stall. Starts the thread on first use."""
        self._last = time.monotonic()
        self._armed = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="megazero-stall-watch", daemon=True)
            self._thread.start()

    def disarm(self) -> None:
        """Between steps (checkpoints, evaluation, the user's own code): no limit."""
        self._armed = False

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll):
            if self._armed and time.monotonic() - self._last > self.limit_s:
                self._fire(time.monotonic() - self._last)
                return

    def _fire(self, silent_s: float) -> None:
        trace = self._dump_flight_recorder()
        self.fired = (f"megazero: rank {self.rank} made no progress for {silent_s:.1f} s inside a training step "
                      f"(limit {self.limit_s:.1f} s): last schedule position: {self._where}. A peer failed or "
                      f"issued another operation; its own message names its position."
                      + (f" NCCL flight recorder: {trace}" if trace else ""))
        print(self.fired, file=sys.stderr, flush=True)
        self._exit(EXIT_CODE)

    def _dump_flight_recorder(self) -> str | None:
        """NCCL's record of this rank's collectives, written to a file (None when torch keeps none)."""
        try:
            from torch._C._distributed_c10d import _dump_nccl_trace  # private; absent on CPU-only builds

            data = _dump_nccl_trace()
        except Exception:  # noqa: BLE001  (no NCCL here, or this torch names it otherwise)
            return None
        path = os.path.join(self.trace_dir or os.getcwd(), f"nccl_trace_rank{self.rank}.pkl")
        with open(path, "wb") as handle:
            handle.write(data)
        return path


__all__ = ["EXIT_CODE", "StallWatch", "limit_for"]
