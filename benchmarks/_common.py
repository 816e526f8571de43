"""Shared pieces of `benchmarks/run.py`: rank spawning, interleaved timing, statistics, checks,
machine information, resident-set peaks and the markdown table.

Every case is a function `case(args) -> dict` (in benchmarks/cases/); the heavy lifting happens in
per-rank worker functions that `run_ranks` starts on N gloo ranks on 127.0.0.1 and whose return
values come back to the parent. Nothing here asserts on wall-clock times.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import platform
import socket
import statistics
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.pipelining",
           "megazero.engine", "deepspeed"]
"""Imported once by the forkserver so a rank costs a fork, not 5-15 s of imports (one that fails to
import, such as an absent deepspeed, is skipped by the forkserver; the rank then reports why)."""


# -- ranks ------------------------------------------------------------------------------------------

class RankError(RuntimeError):
    """A rank raised, died or ran out of time; the message holds its traceback."""


def threads_per_rank(local_ranks: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, local_ranks))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world, port, args, conn, timeout):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads_per_rank(world))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        result = fn(*args)
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
        conn.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")))
    conn.close()
    os._exit(0)  # torch with gloo sometimes aborts at interpreter exit


def run_ranks(fn, world: int, *args, timeout: float = 600.0) -> list:
    """`fn(*args)` on `world` gloo ranks (each with `threads_per_rank(world)` torch threads); the
    results in rank order. A rank's exception, death or a timeout kills all ranks and raises RankError."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    port = _free_port()
    procs, conns = [], []
    for rank in range(world):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, args=(fn, rank, world, port, args, child, timeout), daemon=True)
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    results, errors = {}, {}
    pending = {conns[r]: r for r in range(world)}
    deadline = time.monotonic() + timeout
    try:
        while pending and not errors and time.monotonic() < deadline:
            for obj in wait(list(pending) + [procs[r].sentinel for r in pending.values()], timeout=1.0):
                if obj in pending:
                    rank = pending.pop(obj)
                    try:
                        status, payload = pickle.loads(obj.recv_bytes())
                    except EOFError:
                        status, payload = "error", "died before reporting"
                    (results if status == "ok" else errors)[rank] = payload
            for conn, rank in list(pending.items()):
                if procs[rank].exitcode is not None and not conn.poll():
                    errors[rank] = f"died with exit code {procs[rank].exitcode} before reporting"
                    pending.pop(conn)
        if errors:
            rank = min(errors)
            raise RankError(f"rank {rank} of {world} failed: {errors[rank]}")
        if pending:
            raise RankError(f"timeout after {timeout:.0f} s: ranks {sorted(pending.values())} of {world} did not finish")
        return [results[r] for r in range(world)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        for c in conns:
            c.close()


def failure(err: BaseException) -> str:
    """A one-paragraph reason for the JSON: the exception's type and message, and, for a rank's
    error, the last lines of its traceback."""
    text = f"{type(err).__name__}: {err}"
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[:2] + (["..."] + lines[-4:] if len(lines) > 6 else lines[2:]))


# -- timing -----------------------------------------------------------------------------------------

def interleaved_windows(contestants: dict, warmup: int, repeats: int, window: int, sync=None) -> dict:
    """Time `contestants` (name -> step function returning the step's loss) A/B/A/B: each is warmed
    up `warmup` steps, then, `repeats` times, each runs a window of `window` steps in turn. Returns
    name -> {"step_s": [median step of each window], "losses": [loss of every timed step]}. `sync()`
    (a barrier) runs before each timed step so that every rank times the same step."""
    import torch

    out = {name: {"step_s": [], "losses": [], "warmup_losses": []} for name in contestants}
    for name, step in contestants.items():
        for _ in range(warmup):
            out[name]["warmup_losses"].append(float(step()))
    for _ in range(repeats):
        for name, step in contestants.items():
            secs = []
            for _ in range(window):
                if sync is not None:
                    sync()
                start = time.perf_counter()
                loss = step()
                loss = float(loss.item() if isinstance(loss, torch.Tensor) else loss)
                secs.append(time.perf_counter() - start)
                out[name]["losses"].append(loss)
            out[name]["step_s"].append(statistics.median(secs))
    return out


def slowest_rank(per_rank: list[dict], name: str) -> list[float]:
    """Each window's step time as the slowest rank measured it (the step ends when every rank is done)."""
    return [max(r[name]["step_s"][i] for r in per_rank) for i in range(len(per_rank[0][name]["step_s"]))]


# -- statistics -------------------------------------------------------------------------------------

def spread(values, digits: int = 4) -> dict:
    """{"median", "min", "max", "n"} of `values` (None when empty)."""
    values = [float(v) for v in values if v is not None]
    if not values:
        return None
    r = (lambda x: round(x, digits)) if digits is not None else (lambda x: x)
    return {"median": r(statistics.median(values)), "min": r(min(values)), "max": r(max(values)), "n": len(values)}


def ratio(ours, peer, digits: int = 3) -> dict:
    """megazero / peer per repeat pair, then its spread (above 1: megazero takes longer or uses more)."""
    return spread([a / b for a, b in zip(ours, peer) if b], digits)


def max_rel_diff(got, want) -> float:
    """max |got - want| / max |want| over two equal-length sequences."""
    got, want = [float(x) for x in got], [float(x) for x in want]
    if len(got) != len(want):
        return float("inf")
    scale = max((abs(w) for w in want), default=0.0) or 1.0
    return max((abs(g - w) for g, w in zip(got, want)), default=0.0) / scale


def check_equal(name: str, got, want, tol: float, what: str = "losses") -> dict:
    """The agreement check a case makes before it reports a ratio."""
    err = max_rel_diff(got, want)
    return {"what": f"{what}: {name}", "max_rel_diff": float(f"{err:.3g}"), "tolerance": tol,
            "ok": bool(err <= tol)}


# -- machine ---------------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version_of(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception as err:  # noqa: BLE001 - an absent peer is reported, not raised
        return f"not importable ({type(err).__name__}: {err})"


def machine_info() -> dict:
    import torch

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
            "deepspeed": version_of("deepspeed"), "python": platform.python_version(),
            "platform": platform.platform(), "cuda": torch.cuda.is_available(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
            "threads_per_rank": "max(1, cores // local ranks)"}


# -- resident set (Linux) ---------------------------------------------------------------------------

def mmap_large_allocations(threshold: int = 65536) -> None:
    """glibc: allocations above `threshold` bytes get their own mmap and go back to the OS when freed,
    so the resident set shows what is really held (call first thing in a rank process)."""
    import ctypes
    import ctypes.util

    ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, threshold)  # M_MMAP_THRESHOLD


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) * 1024


def rss_now() -> int:
    import gc

    gc.collect()
    return _status_bytes("VmRSS")


def reset_peak() -> int:
    """Reset the resident-set peak (VmHWM) to the current size; returns that size in bytes."""
    now = rss_now()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return now


def peak_rss() -> int:
    return _status_bytes("VmHWM")


# -- the table --------------------------------------------------------------------------------------

def fmt(s: dict | None, unit: str = "", scale: float = 1.0, digits: int = 3) -> str:
    """"median [min-max]" of a spread."""
    if not s:
        return "-"
    g = lambda x: f"{x * scale:.{digits}g}"  # noqa: E731
    return f"{g(s['median'])}{unit} [{g(s['min'])}-{g(s['max'])}]"


def markdown(results: dict, machine: dict) -> str:
    """One table over every case's rows; each case returns "rows": [{"case", "what", "megazero",
    "peer", "ratio", "check"}], strings already formatted."""
    lines = [f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, "
             f"deepspeed {machine['deepspeed']}, {machine['date']}", "",
             "| case | what | megazero | peer | megazero / peer | check |", "|---|---|---|---|---|---|"]
    for name, res in results.items():
        for row in res.get("rows", []):
            lines.append("| " + " | ".join(str(row.get(k, "")) for k in ("case", "what", "megazero", "peer", "ratio",
                                                                         "check")) + " |")
        if res.get("error"):
            lines.append(f"| {name} | failed | - | - | - | {res['error'].splitlines()[0][:160]} |")
        for note in res.get("notes", []):
            lines.append(f"| {name} | note | | | | {note} |")
    lines.append("")
    lines.append("Times are median [min-max] over repeats; a ratio is megazero / peer per repeat pair "
                 "(below 1: megazero faster or smaller). A ratio is shown only where the check passed.")
    return "\n".join(lines) + "\n"
