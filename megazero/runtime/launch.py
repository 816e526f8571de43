"""Process-group start-up for torchrun, Slurm (srun), Open MPI (mpirun), DeepSpeed's launcher and single
processes.

`init_distributed(timeout_s, backend, env)` takes this process's rank, world size, local rank and
rendezvous address (MASTER_ADDR / MASTER_PORT, exported by the batch script under Slurm or mpirun) from the
launcher's environment (`megazero/core/launch_env.py:read_launch_env`, the one reader of those variables),
its device from `megazero/runtime/device.py:compute_device` (NCCL when that is a GPU, gloo otherwise, or
the configured backend), gives each local rank max(1, cores // local ranks) torch threads, and initialises
the default group with the configured timeout. Without any launcher it runs as a single process (world
size 1) and creates no process group.

On NCCL (`nccl_environment`, before the CUDA context exists) it sets, unless the user already has:

* ``CUDA_DEVICE_MAX_CONNECTIONS=1``: one hardware queue per device, so kernels start in the order
  they were issued across streams; the TP overlap (a column region's all-reduce in flight while its
  weight-gradient GEMMs run) relies on the collective being queued first.
* ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``: a collective that times out or fails ends the process
  (without NCCL's clean-up, which can itself hang) instead of leaving it blocked.
* ``TORCH_NCCL_TRACE_BUFFER_SIZE=2000`` and ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``: NCCL's flight recorder
  keeps the last 2,000 collectives of every group and writes them on a timeout
  (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, default /tmp/nccl_trace_rank_<rank>).

The default group is initialised without ``device_id``: NCCL then builds each group's communicator
at its first collective instead of every group's at once.

Restarted by torchrun (``--max-restarts``, or an elastic ``--nnodes=MIN:MAX`` group re-formed), the
workers of the new attempt get the same MASTER_ADDR:MASTER_PORT: a store the agent keeps across
attempts (TORCHELASTIC_USE_AGENT_STORE=True), still holding the dead attempt's keys. The default
group's rendezvous over it would read those keys and connect to the dead ranks' addresses (gloo:
"connectFullMesh failed ... Connection refused"; NCCL: a stale unique id; pytorch#135712). So under
the agent's store (`attempt_store`) rank 0 starts a store of its own on a free port and posts its
address and a fresh token on the agent's; the other ranks take the posted address only once a store
answers there with that token: the dead attempt's store went with its processes, so whatever answers is
this attempt's. Every rank under torchrun also ends when its agent does (`follow_agent`).
"""
from __future__ import annotations

import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megazero.core.launch_env import LaunchEnv, read_launch_env
from megazero.runtime.device import compute_device


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str | None


NCCL_ENVIRONMENT = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
                    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
"""What megazero sets for an NCCL run when the environment does not say otherwise (module docstring)."""


def nccl_environment(backend: str = "auto", device: torch.device | None = None) -> dict[str, str]:
    """Set `NCCL_ENVIRONMENT`'s variables the user has not set, when this process will use CUDA (`device`;
    default: `compute_device` of the launcher's environment) and NCCL (`backend` auto or nccl); returns the
    ones set here. Call it before anything creates the CUDA context (CUDA_DEVICE_MAX_CONNECTIONS is read
    then)."""
    if device is None:
        device = compute_device(read_launch_env(os.environ), backend)
    if device.type != "cuda" or backend not in ("auto", "nccl"):
        return {}
    added = {k: v for k, v in NCCL_ENVIRONMENT.items() if k not in os.environ}
    os.environ.update(added)
    return added


def init_distributed(timeout_s: float = 300, backend: str = "auto", env: LaunchEnv | None = None) -> DistInfo:
    """Initialise the default process group (if not already) and return this process' facts; `env`: the
    launcher's environment (default: `read_launch_env` of os.environ). Creates the default group over the
    whole world (a collective rendezvous of every rank) when the world has more than one rank."""
    env = read_launch_env(os.environ) if env is None else env
    rank, world = env.rank, env.world_size
    follow_agent(env)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, env.local_world_size)))
    device = compute_device(env, backend)
    nccl_environment(backend, device)
    use_cuda = device.type == "cuda"
    if use_cuda:
        torch.cuda.set_device(device)
    chosen = None
    if dist.is_initialized():
        chosen = dist.get_backend()
        rank, world = dist.get_rank(), dist.get_world_size()
    elif world > 1:
        chosen = ("nccl" if use_cuda else "gloo") if backend == "auto" else backend
        if env.master_addr is None or env.master_port is None:
            raise RuntimeError(f"a world of {world} ranks ({env.launcher}) but MASTER_ADDR/MASTER_PORT are not set: "
                               f"launch with torchrun, or export them in your Slurm or mpirun script (docs/cluster.md)")
        store = attempt_store(rank, world, env.master_addr, env.master_port, timeout_s) if env.agent_store else None
        # no device_id: with it NCCL would build every new_group's communicator at once (eager init); the
        # rendezvous at MASTER_ADDR:MASTER_PORT, the TCPStore torch's env:// would make from the same variables
        init_method = None if store is not None else f"tcp://{_bracketed(env.master_addr)}:{env.master_port}"
        dist.init_process_group(chosen, init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s), store=store)
    return DistInfo(rank, world, env.local_rank, env.local_world_size, device, chosen)


def _bracketed(host: str) -> str:
    """`host` as it goes into a tcp:// URL (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def follow_agent(env: LaunchEnv) -> None:
    """Under torchrun (`env.elastic_run_id` set), on Linux: have the kernel send this rank SIGTERM when its agent,
    the parent process, dies, as when the node goes down; otherwise the agent's ranks would train on, orphaned,
    while the other agents wait for it, and an elastic job could not re-form without them. A rank already
    orphaned ends at once. Local."""
    if env.elastic_run_id is None or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the agent died before the call
        os._exit(1)


def _address_towards(host: str) -> str:
    """This machine's address on the interface that reaches `host` (where the other ranks reach it too; the
    agent's store need not be on rank 0's node). No packet is sent."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.getfqdn()


ATTEMPT_KEY = "megazero/attempt_store"
"""The agent's store key under which rank 0 posts "host:port:token" of this attempt's store."""


def attempt_store(rank: int, world: int, host: str, port: int, timeout_s: float,
                  probe_s: float = 2.0) -> dist.TCPStore:
    """This attempt's own store for the default group under torchrun's agent store at `host`:`port`
    (MASTER_ADDR:MASTER_PORT, module docstring):
    rank 0 serves it on a free port and posts "its address:port:token" under `ATTEMPT_KEY` on the
    agent's store; every other rank reads the post and connects (each try `probe_s` long), until a store
    there holds the same token under `ATTEMPT_KEY` (a post left by a dead attempt names a store that is gone).
    Raises TimeoutError after `timeout_s`. Talks only to the stores, before any process group exists."""
    timeout = timedelta(seconds=timeout_s)
    agent = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    if rank == 0:
        token = uuid.uuid4().hex
        own = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        own.set(ATTEMPT_KEY, token)
        agent.set(ATTEMPT_KEY, f"{_address_towards(host)}:{own.port}:{token}")
        return own
    deadline = time.monotonic() + timeout_s
    while True:
        addr, posted, token = agent.get(ATTEMPT_KEY).decode().rsplit(":", 2)
        try:
            socket.create_connection((addr, int(posted)), timeout=probe_s).close()  # refused at once: a dead store
            own = dist.TCPStore(addr, int(posted), is_master=False, timeout=timedelta(seconds=probe_s))
            if own.get(ATTEMPT_KEY).decode() == token:
                own.set_timeout(timeout)
                return own
        except (RuntimeError, OSError, ValueError):  # a dead attempt's store (refused), or not ours
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: no store of this attempt answered at the address rank 0 posts on "
                               f"the agent's store ({ATTEMPT_KEY!r}) within {timeout_s:.0f} s")
        time.sleep(0.2)
