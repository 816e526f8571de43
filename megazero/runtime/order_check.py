"""The order check: every member of a communicator issues the same collectives in the same order.

NCCL matches collectives by their position on a communicator: if one rank skips a bucket's
reduce-scatter, or issues two of them in another order, the others sum the wrong buffers together or
wait forever. gloo often hides both. With the check on (`comm.verify_order: true`, or the environment
variable ``MEGAZERO_VERIFY_ORDER=1``, which the test suite sets), `megazero.runtime.comm` describes each
operation before issuing it (`OpRecord`: kind, dtype, element count, reduce op, root or peer, an
optional tag such as a bucket index, and the call site) and posts it to the job's rendezvous store:

- **collectives**: record k of a process group goes to the store under that group's k-th position,
  ``mzorder/<group>/<k>``; the member that completes the position (an atomic counter tells it it is the
  last) reads every member's record and compares them (the call site is reported, not compared: two
  functions may legitimately issue the same collective);
- **point-to-point**: sends from rank s to rank d are matched in order with d's receives from s, under
  ``mzorder/<group>/<s>><d>/<k>``: same dtype and shape.

A mismatch raises `OrderError` on the rank that found it, naming the group, the position and both
sides; the message is posted to the store (``mzorder/error``) and a watchdog thread on every other
rank reads it: the rank raises it at its next communication call, or, if it is blocked inside one
(gloo and NCCL cannot be interrupted), prints it and exits. The watchdog also finds what never
completes: when this rank's oldest unmatched record is `stall_s` old it publishes what it waits for;
ranks that wait on each other in a cycle for `stall_s` more (each waits for a record the next one
never posts, because it is blocked on another group) are a deadlock, reported with every wait of
the cycle; any record unmatched after `hang_s` is reported with the members that never posted it.
Both fire well before the collective timeout.

Cost when on: two store round trips per operation (append the record, count the arrival), and one
read for the last member; the store keys of a completed position are deleted. Off, nothing runs.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass

ENV = "MEGAZERO_VERIFY_ORDER"
_PREFIX = "mzorder"
_ERROR_KEY = f"{_PREFIX}/error"
_EXIT_CODE = 70


class OrderError(RuntimeError):
    """Members of one process group issued different operations at the same position."""


def enabled_by_env() -> bool:
    """Whether the environment asks for the order check (``MEGAZERO_VERIFY_ORDER`` = 1/true/yes)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class OpRecord:
    """One operation as a member of a group issues it. `compared` is what every member must agree on
    (for p2p: dtype and shape); `site` is where the program issued it (file:line in function)."""

    rank: int
    kind: str
    compared: str
    site: str

    def encode(self) -> bytes:
        return (json.dumps([self.rank, self.kind, self.compared, self.site]) + "\n").encode()

    @staticmethod
    def decode_all(blob: bytes) -> list["OpRecord"]:
        return [OpRecord(*json.loads(line)) for line in blob.decode().splitlines() if line]

    def describe(self) -> str:
        return f"rank {self.rank}: {self.kind} {self.compared} {self.site}"


COMM_FILES = ("runtime/comm.py", "runtime/order_check.py", "runtime/hierarchical.py")
"""The communication layer's files: a call site is the first frame outside them."""


def call_site(skip_files: tuple[str, ...] = COMM_FILES) -> str:
    """The first caller outside the communication layer, as 'path:line in function'."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.replace(os.sep, "/").endswith(skip_files):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename.replace(os.sep, "/")
    short = path[path.rfind("megazero/"):] if "megazero/" in path else os.path.basename(path)
    return f"{short}:{frame.f_lineno} in {frame.f_code.co_name}"


class _Position:
    """This rank's record at one position of one sequence, waiting for the other participants."""

    __slots__ = ("key", "label", "members", "record", "posted")

    def __init__(self, key, label, members, record, posted):
        self.key, self.label, self.members, self.record, self.posted = key, label, members, record, posted


class OrderCheck:
    """Records and compares this rank's operations per process group through `store` (the job's
    rendezvous store, shared by every rank). One per `ParallelContext`; thread-safe (backward hooks
    and the background checkpoint thread issue operations too).

    `stall_s`: how long a record may stay unmatched before this rank publishes what it waits for and
    looks for a cycle of waits; `hang_s`: how long before an unmatched record is an error on its own.
    """

    def __init__(self, store, rank: int, stall_s: float = 5.0, hang_s: float = 120.0, poll_s: float = 0.5):
        self.store, self.rank = store, rank
        self.stall_s, self.hang_s, self.poll_s = stall_s, hang_s, poll_s
        self._lock = threading.Lock()
        self._next: dict[str, int] = {}            # sequence name -> this rank's next position in it
        self._open: dict[str, list[_Position]] = {}  # sequence name -> its unmatched positions, oldest first
        self._error: str | None = None
        self._raised = False
        self._cycle: tuple | None = None  # the cycle of waits seen at the last poll, and since when
        self._published = False  # whether this rank's wait is posted (mzorder/waits/<rank>)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- posting ------------------------------------------------------------------------------
    def collective(self, group, kind: str, compared: str, tensors=()) -> None:
        """Post this rank's next collective on `group` (a GroupHandle with a process group) and, if
        this rank completes the position, compare every member's record. Raises OrderError. (`tensors`:
        what enters the collective; the dry run's recorder checks their device, this check does not.)"""
        # the sequence is the communicator's: two axes with the same members may share one process group
        self._post(f"pg{_pg_name(group.pg)}", f"group {group.axis} (ranks {list(group.ranks)})", group.ranks,
                   OpRecord(self.rank, kind, compared, f"on {group.axis} at {call_site()}"))

    def p2p(self, group, kind: str, peer: int, compared: str, tensors=()) -> None:
        """Post a send to (kind "send") or a receive from (kind "recv") group rank `peer`: matched in
        order with the peer's receives from (sends to) this rank, on the same dtype and shape."""
        me, other = group.ranks[group.rank], group.ranks[peer]
        src, dst = (me, other) if kind == "send" else (other, me)
        self._post(f"pg{_pg_name(group.pg)}/{src}>{dst}", f"p2p {src} -> {dst} on group {group.axis}", (src, dst),
                   OpRecord(self.rank, kind, compared, f"on {group.axis} at {call_site()}"))

    def _post(self, name: str, label: str, members: tuple[int, ...], record: OpRecord) -> None:
        self.raise_if_failed()
        with self._lock:
            pos = self._next.get(name, 0)
            self._next[name] = pos + 1
        key = f"{_PREFIX}/{name}/{pos}"
        self.store.append(key, record.encode())
        arrived = self.store.add(key + "/n", 1)
        if arrived == len(members):
            records = OpRecord.decode_all(self.store.get(key))
            self.store.delete_key(key)
            self.store.delete_key(key + "/n")
            self._compare(label, pos, records)
            return
        with self._lock:
            self._open.setdefault(name, []).append(_Position(key, label, members, record, time.monotonic()))
        self._start_watchdog()

    def _compare(self, label: str, pos: int, records: list[OpRecord]) -> None:
        """Raise (after posting the error for every rank) when the records of one position differ."""
        first = records[0]
        for other in records[1:]:
            if other.compared != first.compared or _kind_class(other.kind) != _kind_class(first.kind):
                sides = "\n  ".join(r.describe() for r in sorted(records, key=lambda r: r.rank))
                self.fail(f"order check: {label} diverges at operation #{pos}:\n  {sides}")

    # -- failing ------------------------------------------------------------------------------
    def fail(self, message: str) -> None:
        """Post `message` for every rank and raise it here."""
        with self._lock:
            if self._error is None:
                self._error = message
                try:
                    self.store.set(_ERROR_KEY, message)
                except Exception:  # the store itself failing must not hide the divergence
                    pass
            self._raised = True
        raise OrderError(self._error)

    def raise_if_failed(self) -> None:
        """Raise the divergence another rank (or the watchdog) found, if any."""
        if self._error is not None:
            self._raised = True
            raise OrderError(self._error)

    def close(self) -> None:
        self._stop.set()

    # -- the watchdog -------------------------------------------------------------------------
    def _start_watchdog(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._watch, name="megazero-order-check", daemon=True)
                    self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                message = self._poll()
            except Exception:  # the store is gone: the job is ending
                return
            if message is None:
                continue
            with self._lock:
                if self._error is None:
                    self._error = message
                    try:
                        self.store.set(_ERROR_KEY, message)
                    except Exception:
                        pass
            # the main thread raises at its next communication call; blocked inside one, it cannot
            deadline = time.monotonic() + 3 * self.poll_s + 1.0
            while time.monotonic() < deadline and not self._raised:
                time.sleep(0.1)
            if not self._raised:
                sys.stderr.write(f"[rank {self.rank}] {self._error}\n[rank {self.rank}] stopped by the order "
                                 f"check while blocked in a collective\n")
                sys.stderr.flush()
                os._exit(_EXIT_CODE)
            return

    def _poll(self) -> str | None:
        """One look at the store: another rank's error, completed positions, stalls, cycles, hangs."""
        if self._error is not None:
            return self._error
        if self.store.check([_ERROR_KEY]):
            return self.store.get(_ERROR_KEY).decode()
        now = time.monotonic()
        oldest = None
        with self._lock:
            open_now = {name: list(positions) for name, positions in self._open.items() if positions}
        for name, positions in open_now.items():
            # a member that posted position k posted every position before it: one read clears them all
            if self._complete(positions[-1]):
                with self._lock:
                    self._open[name] = [p for p in self._open[name] if p.posted > positions[-1].posted]
                continue
            for p in positions:
                if not self._complete(p):
                    if oldest is None or p.posted < oldest.posted:
                        oldest = p
                    break
        status_key = f"{_PREFIX}/waits/{self.rank}"
        if oldest is None or now - oldest.posted < self.stall_s:
            if self._published:
                self.store.delete_key(status_key)
                self._published, self._cycle = False, None
            return None
        posted = OpRecord.decode_all(self.store.get(oldest.key)) if self.store.check([oldest.key]) else []
        missing = sorted(set(oldest.members) - {r.rank for r in posted})
        wait = {"label": oldest.label, "key": oldest.key, "record": oldest.record.describe(), "missing": missing}
        self.store.set(status_key, json.dumps(wait))
        self._published = True
        if now - oldest.posted >= self.hang_s:
            return (f"order check: {oldest.label}: operation {oldest.key.rsplit('/', 1)[1]} "
                    f"({oldest.record.describe()}) unmatched for {now - oldest.posted:.0f}s; ranks {missing} "
                    f"never issued it")
        cycle = self._find_cycle(wait)
        if cycle is None:
            self._cycle = None
            return None
        signature = tuple(w["key"] for w in cycle)
        if self._cycle is None or self._cycle[0] != signature:
            self._cycle = (signature, now)
            return None
        if now - self._cycle[1] < self.stall_s:
            return None
        lines = "\n  ".join(f"{w['record']}, waiting for ranks {w['missing']}" for w in cycle)
        return f"order check: deadlock, these ranks wait on each other:\n  {lines}"

    def _complete(self, p: _Position) -> bool:
        """Whether every participant posted position `p` (its last one deleted the keys: the count
        reads 0, which a live position never does, since this rank counted itself)."""
        arrived = int(self.store.add(p.key + "/n", 0))
        if arrived == 0:
            self.store.delete_key(p.key + "/n")
            return True
        return arrived >= len(p.members)

    def _find_cycle(self, mine: dict) -> list[dict] | None:
        """Follow published waits from this rank; a chain that comes back to a rank already in it is
        a cycle (each waits for a record the next never posts)."""
        chain, seen = [mine], {self.rank}
        current = mine
        while current["missing"]:
            nxt = current["missing"][0]
            if nxt in seen:
                return chain
            key = f"{_PREFIX}/waits/{nxt}"
            if not self.store.check([key]):
                return None  # that rank is not waiting: it is computing, the wait may end
            current = json.loads(self.store.get(key))
            chain.append(current)
            seen.add(nxt)
        return None


def _kind_class(kind: str) -> str:
    """Sends and receives pair up; every other kind must be equal."""
    return "p2p" if kind in ("send", "recv") else kind


def _pg_name(pg) -> str:
    """A process group's name, the same on every member (torch numbers groups in creation order)."""
    name = getattr(pg, "group_name", None)
    if name is None:
        import torch.distributed as dist

        name = dist.distributed_c10d._get_process_group_name(pg)
    return str(name)
