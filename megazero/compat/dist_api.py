"""DeepSpeed's `deepspeed.comm`: torch.distributed's functions under DeepSpeed's names and
signatures, each optionally timed by the comms logger.

Every collective here runs over the torch ProcessGroup it is given (None: the default group), as
DeepSpeed's do; megazero's engine does not use them (its collectives go through
`megazero.runtime.comm` over the ParallelContext's groups, counted in its `CommStats`). The comms
logger (`configure`, or the config's ``comms_logger`` section at `initialize`) times the calls made
here while enabled: each one, where profiled (``prof_all``, its name in ``prof_ops``, or
``prof=True``), waits for the device and is recorded as (op, message bytes, latency) in a `CommStats`
(`CommStats.record_time`) of the process's registry (`megazero.compat.engines`); `log_summary`
prints and returns DeepSpeed's table (count, latency, algorithmic and bus bandwidth per op and
message size) plus, for the live engines whose config turned the logger on, their own collectives
per (axis, op) read from their `CommStats`: calls and bytes (not timed: they overlap with compute).
`CommsLogger` is a view over those; it records nothing of its own.
"""
from __future__ import annotations

import functools
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megazero.compat.accelerator import get_accelerator
from megazero.compat.engines import CommsOptions, Registry, registry
from megazero.core.launch_env import read_launch_env
from megazero.runtime.comm import CommStats

ReduceOp = dist.ReduceOp

# DeepSpeed's bandwidth arithmetic (utils/comms_logging.py): the message size is the bytes of the argument
# DeepSpeed names `tensor` (`input_list`, `tensors`, ...); algorithmic bandwidth = moved / latency with
# moved = size x n for the gathering ops, 2 x size for an all-reduce, size otherwise;
# bus bandwidth = algorithmic x (n-1)/n for these collectives, = algorithmic for the rest
_GATHERED = ("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor")
_RING = _GATHERED + ("all_reduce", "all_reduce_coalesced", "all_to_all_single", "all_to_all")


AXIS = "deepspeed.comm"  # the axis under which megazero.comm's own calls are timed in the registry's CommStats


class CommsLogger:
    """DeepSpeed's comms logger, a view: its switches are the registry's `CommsOptions`, its records the
    registry's `CommStats` (`megazero.comm`'s calls, axis `AXIS`) and, in the summary, the `CommStats`
    of the live engines whose config turned the logger on (`megazero.compat.engines`). It keeps nothing."""

    def __init__(self, registry: Registry):
        self.registry = registry

    def __getattr__(self, name: str):
        if name in CommsOptions.switches():
            return getattr(self.registry.comms, name)
        raise AttributeError(f"CommsLogger has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name in CommsOptions.switches():
            setattr(self.registry.comms, name, value)  # a switch set on the view is the registry's
        else:
            super().__setattr__(name, value)

    @property
    def stats(self) -> CommStats:
        """Where `megazero.comm`'s timed calls are recorded."""
        return self.registry.comm_stats

    def engine_stats(self) -> list[CommStats]:
        """The `CommStats` of the live engines built with the config's comms_logger on."""
        return [e.pctx.stats for e in self.registry.engines()
                if e.config is not None and e.config.log.comms_logger.enabled]

    def profiles(self, name: str, prof: bool) -> bool:
        o = self.registry.comms
        return o.enabled and (prof or o.prof_all or name in o.prof_ops)

    def append(self, name: str, nbytes: int, latency_ms: float) -> None:
        self.stats.record_time(AXIS, name, nbytes, latency_ms / 1e3)
        if self.registry.comms.verbose:
            print(f"[megazero.comm] rank={get_rank()} op={name} bytes={nbytes} time_ms={latency_ms:.3f}", flush=True)

    def records(self) -> dict[str, dict[int, tuple[int, float]]]:
        """{op: {message bytes: (calls, total ms)}} of `megazero.comm`'s timed calls."""
        out: dict = {}
        for (axis, op, nbytes), (calls, seconds) in self.stats.timings().items():
            if axis == AXIS:
                out.setdefault(op, {})[nbytes] = (calls, seconds * 1e3)
        return out


def comms_logger() -> CommsLogger:
    """DeepSpeed's `deepspeed.comm.comms_logger`: the view of this process's registry."""
    return CommsLogger(registry())


def configure(deepspeed_config=None, enabled=None, prof_all=None, prof_ops=None, verbose=None, debug=None) -> None:
    """DeepSpeed's `deepspeed.comm.configure`: set the comms logger's options; `deepspeed_config`
    (a dict with a ``comms_logger`` section, or a megazero Config) first, then the keywords."""
    options = registry().comms
    section = None
    if isinstance(deepspeed_config, dict):
        section = deepspeed_config.get("comms_logger")
    elif deepspeed_config is not None:
        section = vars(deepspeed_config.log.comms_logger)
    given = dict(section or {})
    given.update({k: v for k, v in dict(enabled=enabled, prof_all=prof_all, prof_ops=prof_ops, verbose=verbose,
                                        debug=debug).items() if v is not None})
    for key, value in given.items():
        if key not in CommsOptions.switches():
            raise ValueError(f"comms_logger.{key}: unknown option; valid: {', '.join(CommsOptions.switches())}")
        setattr(options, key, list(value) if key == "prof_ops" else bool(value))


def _nbytes(t) -> int:
    if t is None:
        return 0
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(getattr(x, "tensor", x)) for x in t)
    return t.element_size() * t.numel() if isinstance(t, torch.Tensor) else 0


def _timed(name: str, payload: str | None):
    """Wrap a torch.distributed call: with the logger profiling it, wait for the device before and
    after and record its bytes (of argument `payload`) and latency. `prof` and `log_name` are
    DeepSpeed's extra keywords (not passed on); `debug` too."""

    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, prof: bool = False, log_name: str | None = None, debug=None, **kwargs):
            log = comms_logger()
            label = log_name or name
            if not log.profiles(label, prof):
                return fn(*args, **kwargs)
            params = list(fn.__code__.co_varnames[:fn.__code__.co_argcount])
            bound = dict(zip(params, args), **kwargs)
            get_accelerator().synchronize()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                get_accelerator().synchronize()
                log.append(label, _nbytes(bound.get(payload)) if payload else 0, (time.perf_counter() - start) * 1e3)

        return call

    return wrap


# -- process groups and ranks ----------------------------------------------------------------------------

def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500, verbose=True,
                     timeout=timedelta(minutes=30), init_method=None, dist_init_required=None, config=None,
                     rank=-1, world_size=-1) -> None:
    """DeepSpeed's `init_distributed` (also `megazero.init_distributed`): the default process group from the
    launcher's environment (torchrun, Slurm, mpirun or DeepSpeed's launcher: `read_launch_env`), on
    `dist_backend` (None: nccl on GPUs, gloo otherwise).
    `timeout` is a timedelta or seconds. MPI discovery, ports, init methods and explicit ranks are the
    launcher's business here: anything but their defaults is refused, naming the argument."""
    from megazero.runtime.launch import init_distributed as _init

    for name, value, default in (("init_method", init_method, None), ("rank", rank, -1),
                                 ("world_size", world_size, -1)):
        if value != default:
            raise ValueError(f"init_distributed({name}={value!r}): megazero reads rank and world size from the "
                             f"launcher's environment (torchrun, Slurm, mpirun or DeepSpeed's launcher); leave "
                             f"{name} unset")
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else (timeout or 1800)
    return _init(float(seconds), dist_backend or "auto")


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def destroy_process_group(group=None) -> None:
    dist.destroy_process_group(group)


def new_group(ranks):
    """A new torch ProcessGroup of `ranks` (every rank of the world must call it, in the same order)."""
    return dist.new_group(ranks)


def get_world_group():
    return dist.group.WORLD


def get_world_size(group=None) -> int:
    """The size of `group` (None: the world: the launcher's world size before the default group exists)."""
    if group is None and not is_initialized():
        return read_launch_env(os.environ).world_size
    return dist.get_world_size(group)


def get_rank(group=None) -> int:
    """This process's rank in `group` (None: the world: the launcher's rank before the default group exists)."""
    if group is None and not is_initialized():
        return read_launch_env(os.environ).rank
    return dist.get_rank(group)


def get_local_rank() -> int:
    """This process's rank on its node, from the launcher's environment (`read_launch_env`: torchrun's
    LOCAL_RANK, Slurm's SLURM_LOCALID, Open MPI's OMPI_COMM_WORLD_LOCAL_RANK, ...; 0 in a single process)."""
    return read_launch_env(os.environ).local_rank


def get_global_rank(group=None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_all_ranks_from_group(group=None) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(get_world_size()))


# -- collectives (DeepSpeed's signatures; `prof`, `log_name`, `debug` accepted by each) ------------------

@_timed("broadcast", "tensor")
def broadcast(tensor, src, group=None, async_op=False):
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


@_timed("broadcast_object_list", None)
def broadcast_object_list(object_list, src, group=None, device=None):
    return dist.broadcast_object_list(object_list, src, group=group, device=device)


@_timed("all_gather", "tensor")
def all_gather(tensor_list, tensor, group=None, async_op=False):
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list, obj, group=None):
    return dist.all_gather_object(object_list, obj, group=group)


@_timed("all_gather_into_tensor", "tensor")
def all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False):
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False, debug=None):
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op, log_name="allgather_fn")


@_timed("reduce_scatter_tensor", "tensor")
def reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False):
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, debug=None):
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op, prof=prof)


@_timed("reduce_scatter", "input_list")
def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


@_timed("all_reduce", "tensor")
def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


@_timed("all_reduce_coalesced", "tensors")
def all_reduce_coalesced(tensors, op=ReduceOp.SUM, group=None, async_op=False):
    works = [dist.all_reduce(t, op=op, group=group, async_op=async_op) for t in tensors]
    return works if async_op else None


@_timed("reduce", "tensor")
def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False):
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


@_timed("all_to_all_single", "tensor")
def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                  async_op=async_op)


@_timed("all_to_all", "input_tensor_list")
def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


@_timed("send", "tensor")
def send(tensor, dst, group=None, tag=0):
    return dist.send(tensor, dst, group=group, tag=tag)


@_timed("recv", "tensor")
def recv(tensor, src=None, group=None, tag=0):
    return dist.recv(tensor, src, group=group, tag=tag)


@_timed("isend", "tensor")
def isend(tensor, dst, group=None, tag=0):
    return dist.isend(tensor, dst, group=group, tag=tag)


@_timed("irecv", "tensor")
def irecv(tensor, src=None, group=None, tag=0):
    return dist.irecv(tensor, src, group=group, tag=tag)


@_timed("batch_isend_irecv", "p2p_op_list")
def batch_isend_irecv(p2p_op_list):
    """torch's `batch_isend_irecv` (on gloo it can hang, pytorch#132644: prefer isend/irecv there)."""
    return dist.batch_isend_irecv(p2p_op_list)


@_timed("gather", "tensor")
def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    return dist.gather(tensor, gather_list, dst, group=group, async_op=async_op)


@_timed("scatter", "tensor")
def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    return dist.scatter(tensor, scatter_list, src, group=group, async_op=async_op)


@_timed("barrier", None)
def barrier(group=None, async_op=False, device_ids=None):
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


@_timed("monitored_barrier", None)
def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def has_reduce_scatter_tensor() -> bool:
    return True


def has_all_gather_into_tensor() -> bool:
    return True


def has_all_reduce_coalesced() -> bool:
    return True


def has_coalescing_manager() -> bool:
    return False


# -- the comms logger's summary --------------------------------------------------------------------------

def summary(log: CommsLogger | None = None, world_size: int | None = None) -> dict:
    """This rank's logged calls as DeepSpeed's `log_summary` dict: {"summary": {op: {bytes: {count,
    total_latency_ms, avg_latency_ms, tput_avg_gbps, busbw_avg_gbps, msg_size_bytes}}}, "engine":
    {"axis/op": {calls, bytes, ...}}, "metadata": {world_size, rank}}, read from the `CommStats` the
    logger views. Local: no communication."""
    log = log or comms_logger()
    n = world_size or (get_world_size() if is_initialized() else 1)
    table: dict = {}
    for op, sizes in log.records().items():
        for size, (count, total_ms) in sorted(sizes.items()):
            avg = total_ms / count
            moved = size * n if op in _GATHERED else size * (2 if op.startswith("all_reduce") else 1)
            tput = moved / (avg / 1e3) * 8 / 1e9 if avg > 0 else 0.0  # Gbit/s
            table.setdefault(op, {})[size] = {
                "count": count, "total_latency_ms": total_ms, "avg_latency_ms": avg,
                "tput_avg_gbps": tput, "busbw_avg_gbps": tput * ((n - 1) / n if op in _RING else 1.0),
                "msg_size_bytes": size}
    engine: dict = {}
    for stats in log.engine_stats():
        for key, row in stats.snapshot().items():
            mine = engine.setdefault(key, {"calls": 0, "bytes": 0.0, "inter_node_bytes": 0.0})
            mine["calls"] += row["calls"]
            mine["bytes"] += row["bytes"]
            mine["inter_node_bytes"] += row["inter_node_bytes"]
    return {"summary": table, "engine": engine,
            "metadata": {"world_size": n, "rank": get_rank() if is_initialized() else 0}}


def log_summary(show_straggler: bool = False, return_dict: bool = False):
    """DeepSpeed's `log_summary`: a barrier over the default group, rank 0 prints this rank's table
    (and the engine's counters), a second barrier; the dict when `return_dict`. `show_straggler`
    (DeepSpeed's all-reduced min/max latencies) is refused: megazero's straggler report is the
    trainer's."""
    if show_straggler:
        raise NotImplementedError("log_summary(show_straggler=True): not provided; compare the ranks' "
                                  "log_summary(return_dict=True) yourself")
    barrier(log_name="log_summary_barrier")
    result = summary()
    if result["metadata"]["rank"] == 0:
        print(format_summary(result), flush=True)
    barrier(log_name="log_summary_barrier")
    return result if return_dict else None


def format_summary(result: dict) -> str:
    lines = [f"{'Comm. Op':<24}{'Message Size':>14}{'Count':>8}{'Total Latency(ms)':>20}{'Avg Latency(ms)':>18}"
             f"{'tput_avg (Gbps)':>17}{'busbw_avg (Gbps)':>18}"]
    for op, sizes in sorted(result["summary"].items()):
        for size, row in sizes.items():
            lines.append(f"{op:<24}{size:>14}{row['count']:>8}{row['total_latency_ms']:>20.2f}"
                         f"{row['avg_latency_ms']:>18.3f}{row['tput_avg_gbps']:>17.2f}{row['busbw_avg_gbps']:>18.2f}")
    if result["engine"]:
        lines.append(f"{'engine collective (axis/op)':<36}{'calls':>8}{'bytes':>16}{'inter-node bytes':>18}")
        for key, row in sorted(result["engine"].items()):
            lines.append(f"{key:<36}{row['calls']:>8}{row['bytes']:>16.0f}{row['inter_node_bytes']:>18.0f}")
    return "\n".join(lines)


def reset_log() -> None:
    """Forget what was logged (DeepSpeed's, e.g. per epoch): `megazero.comm`'s records and the logged
    engines' counters."""
    log = comms_logger()
    log.stats.reset()
    for stats in log.engine_stats():
        stats.reset()


def has_comm_data() -> bool:
    return bool(comms_logger().records())


def get_comm_operation_count() -> int:
    return sum(count for sizes in comms_logger().records().values() for count, _ in sizes.values())


def get_logged_comm_ops() -> list[str]:
    return sorted(comms_logger().records())
