"""Run a function on N gloo ranks on 127.0.0.1 and collect each rank's result.

`run_ranks(fn, n, *args, timeout=...)` starts n processes (forkserver with torch and megazero
preloaded, so a start costs a fork, not an import), initialises a gloo process group on a free port, calls
`fn(*args, **kwargs)` on each rank and returns the list of results in rank order. Any rank's
exception is re-raised here with its rank and traceback; a rank that dies or a run that exceeds
`timeout` kills every rank and raises — no test can hang the suite; a rank that dies is reported with
the end of what it wrote to stderr. The order check is on (``MEGAZERO_VERIFY_ORDER=1``) in every rank. Each rank gets
max(1, cores // n) torch threads, and ends with os._exit(0) once its result is sent (torch 2.13
with gloo sometimes aborts at interpreter exit).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait


class RankError(RuntimeError):
    """A rank raised, died, or did not finish in time."""


def mmap_large_allocations(threshold: int = 65536) -> None:
    """glibc: allocations above `threshold` bytes get their own mmap and go back to the OS when freed
    (a fixed threshold, no dynamic raising), so that a resident-set peak shows what a step really
    allocates. Call it first thing in a rank process: an environment variable would not reach
    processes forked from a forkserver that started earlier."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "megazero.engine", "megazero.models", "megazero.toolbox.parity"]
"""Imported once by the forkserver, so that no rank pays for them: torch, torch._dynamo (which
torch.utils.checkpoint and torch's optimizers import on first use, 2-3 s each time) and megazero's
engine stack (0.6 s). None of them starts a thread or holds state a test changes."""


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _rank_main(fn, rank, world, port, args, kwargs, conn, timeout, stderr_path):
    with open(stderr_path, "w") as err:  # what the rank writes to fd 2 (a rank stopped by the order check
        os.dup2(err.fileno(), 2)         # says why there), quoted in the error when it dies
    os.environ.setdefault("MEGAZERO_VERIFY_ORDER", "1")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout))
        result = fn(*args, **kwargs)
        # plain pickle: tensors travel by value (torch's ForkingPickler would share their memory
        # through this process, which exits right after)
        conn.send_bytes(pickle.dumps(("ok", result)))
        try:
            # rank 0 hosts the store, which the order check uses on every operation: it stays until
            # every rank is done (a rank that failed never comes; the parent stops the others)
            dist.barrier()
            dist.destroy_process_group()
        except Exception:
            pass
    except BaseException as exc:  # report every failure, including KeyboardInterrupt/SystemExit
        conn.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")))
    conn.close()
    os._exit(0)


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return the results in rank order.

    `fn` must be importable (a module-level function). Raises RankError naming the failing rank.
    """
    for attempt in range(2):
        try:
            return _run_once(fn, world_size, args, kwargs, timeout)
        except RankError as err:
            if attempt == 0 and "address already in use" in str(err).lower():
                continue  # the free port was taken between choosing and binding
            raise
    raise AssertionError("unreachable")


def _stderr_tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    return f"; its stderr ends:\n{text[-chars:]}" if text.strip() else ""


def _run_once(fn, world, args, kwargs, timeout):
    ctx = _context()
    port = free_port()
    procs, conns = [], []
    logs = tempfile.mkdtemp(prefix="megazero-ranks-")
    stderr_paths = [os.path.join(logs, f"rank{r}.stderr") for r in range(world)]
    for rank in range(world):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, args=(fn, rank, world, port, args, kwargs, child, timeout,
                                                 stderr_paths[rank]),
                        name=f"rank{rank}", daemon=True)
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    grace_end = None  # after a first error, collect the others' reports briefly, then stop all
    pending = {conns[r]: r for r in range(world)}
    try:
        while pending and time.monotonic() < min(deadline, grace_end or deadline):
            ready = wait(list(pending) + [procs[r].sentinel for r in pending.values()],
                         timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            for obj in ready:
                if obj in pending:
                    rank = pending.pop(obj)
                    try:
                        status, payload = pickle.loads(obj.recv_bytes())
                    except EOFError:
                        procs[rank].join(timeout=2)
                        status, payload = "error", (f"died with exit code {procs[rank].exitcode} before reporting"
                                                    + _stderr_tail(stderr_paths[rank]))
                    (results if status == "ok" else errors)[rank] = payload
                    if errors and grace_end is None:
                        grace_end = time.monotonic() + 3.0
            for conn, rank in list(pending.items()):
                if procs[rank].exitcode is not None and not conn.poll():
                    errors[rank] = (f"died with exit code {procs[rank].exitcode} before reporting"
                                    + _stderr_tail(stderr_paths[rank]))
                    pending.pop(conn)
                    grace_end = grace_end or time.monotonic() + 3.0
        if errors:
            first, *others = errors  # in order of arrival: the first is usually the cause
            also = "".join(f"\n--- rank {r} also failed: {errors[r]}" for r in others)
            raise RankError(f"rank {first} of {world} failed: {errors[first]}{also}")
        if pending:
            waiting = sorted(pending.values())
            raise RankError(f"timeout after {timeout:.0f}s: ranks {waiting} of {world} did not finish "
                            f"(finished: {sorted(results)})")
        return [results[r] for r in range(world)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        for c in conns:
            c.close()
        shutil.rmtree(logs, ignore_errors=True)
