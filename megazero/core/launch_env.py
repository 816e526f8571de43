"""The launcher's environment as one value: who started this process, its rank, its node, its rendezvous.

`read_launch_env(environ)` is the one place megazero reads the variables launchers set (the caller passes
``os.environ``; tests pass dicts). Every other module asks it (`tests/test_launch_env.py` parses megazero for
these names). It knows four launchers and a single process:

=========  ===================================================================================================
torchrun   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (node), GROUP_WORLD_SIZE (nodes),
           TORCHELASTIC_RUN_ID (the agent is the parent), TORCHELASTIC_USE_AGENT_STORE; also any tool that sets
           the env:// variables RANK and WORLD_SIZE by hand
deepspeed  DeepSpeed's launcher (deepspeed/launcher/launch.py): RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE
           (ranks on this node), CROSS_RANK (node), CROSS_SIZE (nodes); its MPICH / Intel MPI runners set
           RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_SIZE
openmpi    mpirun: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK,
           OMPI_COMM_WORLD_LOCAL_SIZE (Open MPI names no node index: it is known only on one node)
slurm      srun: SLURM_PROCID, SLURM_STEP_NUM_TASKS / SLURM_NTASKS / SLURM_NPROCS, SLURM_LOCALID,
           SLURM_NODEID, SLURM_STEP_NUM_NODES / SLURM_NNODES, and the tasks per node from
           SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE / SLURM_NTASKS_PER_NODE ("4", "4(x2)",
           "2(x3),1": this node's entry, by SLURM_NODEID)
none       none of these: one process, rank 0 of 1
=========  ===================================================================================================

MASTER_ADDR and MASTER_PORT (the rendezvous of the default group) are read under every launcher: torchrun
and DeepSpeed's launcher set them, a Slurm or mpirun script exports them.

Precedence: the env:// variables (RANK, WORLD_SIZE, LOCAL_RANK, ...) beat a scheduler's, since a launcher
started under a scheduler (torchrun inside srun, one task per node) sets them for the processes it starts;
then Open MPI's (set by mpirun for the process it starts directly; a Slurm allocation's SLURM_* variables
may be inherited from the batch shell); then Slurm's. Within one launcher the more specific variable wins
(LOCAL_WORLD_SIZE over LOCAL_SIZE, a step's SLURM_STEP_* over the job's). A field the chosen launcher does
not name is taken from Open MPI's or Slurm's variables only when they describe the same process (the same
rank and world size: DeepSpeed's MPI discovery, or a script exporting RANK=$OMPI_COMM_WORLD_RANK); else all
ranks are taken to be on one node (local world size = world size, local rank = rank mod local world size),
unless the launcher names more than one node, which is then an error.

Bad values raise `LaunchEnvError` naming the variables: not a whole number, negative, a rank not below the
world size, a local rank not below the local world size, more ranks on a node than in the world, a node
index not below the node count, a Slurm tasks-per-node list that does not parse or does not cover
SLURM_NODEID, a variable missing that its launcher always sets with the others (RANK with WORLD_SIZE > 1,
WORLD_SIZE with RANK, any of Open MPI's four, srun's task count and SLURM_LOCALID).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

LAUNCHERS = ("torchrun", "slurm", "openmpi", "deepspeed", "none")
"""The launcher names `LaunchEnv.launcher` takes."""


class LaunchEnvError(ValueError):
    """A launcher variable that is malformed or contradicts another; the message names them."""


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the job, as its launcher set it (`read_launch_env`). `node_rank` and
    `num_nodes` are None where the launcher does not say (Open MPI on more than one node, a hand-set
    RANK/WORLD_SIZE without GROUP_RANK); `master_addr` / `master_port` None where unset; `elastic_run_id`
    is torchrun's TORCHELASTIC_RUN_ID (the agent is this process's parent), `agent_store` whether the
    rendezvous address is the agent's store kept across restarts (TORCHELASTIC_USE_AGENT_STORE=True)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int | None = 0
    num_nodes: int | None = 1
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str = "none"
    elastic_run_id: str | None = None
    agent_store: bool = False


@dataclass
class _Field:
    """One value and where it came from, for error messages: the variable that set it, or (`derived`) why
    it was taken without one."""

    value: int | None = None
    source: str = ""
    derived: bool = False

    def set(self, value: int | None, source: str, derived: bool = False) -> None:
        if self.value is None and value is not None:
            self.value, self.source, self.derived = value, source, derived

    def __str__(self) -> str:
        return f"{self.value} ({self.source})" if self.derived else f"{self.source}={self.value}"


def _present(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip() != ""


def _int(environ: Mapping[str, str], name: str, minimum: int = 0) -> int | None:
    """The whole number in variable `name` (None when unset or empty); a value that is not one, or below
    `minimum`, raises naming the variable."""
    raw = environ.get(name, "")
    if raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise LaunchEnvError(f"{name}={raw!r}: not a whole number; the launcher sets it to one (unset it to run "
                             f"as a single process)") from None
    if value < minimum:
        raise LaunchEnvError(f"{name}={raw!r}: must be at least {minimum}")
    return value


def _first(environ: Mapping[str, str], field: _Field, names: tuple[str, ...], minimum: int = 0) -> None:
    """Set `field` from the first of `names` that is set (each one present is parsed and checked)."""
    for name in names:
        field.set(_int(environ, name, minimum), name)


_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def tasks_per_node(name: str, raw: str) -> list[int]:
    """Slurm's tasks-per-node list (``4``, ``4(x2)``, ``2(x3),1``) expanded to one count per node, in node
    order; a list that does not parse raises naming variable `name`."""
    counts: list[int] = []
    for item in raw.strip().split(","):
        m = _TASKS.match(item.strip())
        if m is None:
            raise LaunchEnvError(f"{name}={raw!r}: not a Slurm tasks-per-node list (like '4', '4(x2)' or "
                                 f"'2(x3),1'); item {item!r} is neither N nor N(xK)")
        count, repeat = int(m.group(1)), int(m.group(2) or 1)
        if count < 1 or repeat < 1:
            raise LaunchEnvError(f"{name}={raw!r}: item {item!r} counts no task; each node runs at least one")
        counts += [count] * repeat
    return counts


class _Read:
    """The fields of one launcher's variables, each with the variable it came from."""

    def __init__(self, launcher: str):
        self.launcher = launcher
        self.rank, self.world, self.local_rank, self.local_world = _Field(), _Field(), _Field(), _Field()
        self.node, self.nodes = _Field(), _Field()


def _env_url(environ: Mapping[str, str]) -> _Read:
    """torchrun's (or DeepSpeed's launcher's, or hand-set) env:// variables."""
    torchrun = any(_present(environ, n) for n in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "GROUP_RANK"))
    deepspeed = any(_present(environ, n) for n in ("LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"))
    r = _Read("deepspeed" if deepspeed and not torchrun else "torchrun")
    _first(environ, r.rank, ("RANK",))
    _first(environ, r.world, ("WORLD_SIZE",), minimum=1)
    _first(environ, r.local_rank, ("LOCAL_RANK",))
    _first(environ, r.local_world, ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"), minimum=1)
    _first(environ, r.node, ("GROUP_RANK", "CROSS_RANK"))
    _first(environ, r.nodes, ("GROUP_WORLD_SIZE", "CROSS_SIZE"), minimum=1)
    if r.rank.value is None and r.world.value is None:  # LOCAL_RANK alone: a single process
        r.rank.set(0, "RANK unset", derived=True)
        r.world.set(1, "WORLD_SIZE unset", derived=True)
    elif r.rank.value is None:
        if r.world.value > 1:
            raise LaunchEnvError(f"WORLD_SIZE={r.world.value} but RANK is not set: a launcher sets both (torchrun, "
                                 f"deepspeed); set RANK to this process's rank, 0 to WORLD_SIZE - 1")
        r.rank.set(0, "RANK unset", derived=True)
    elif r.world.value is None:
        raise LaunchEnvError(f"RANK={r.rank.value} but WORLD_SIZE is not set: a launcher sets both (torchrun, "
                             f"deepspeed); set WORLD_SIZE to the number of processes")
    return r


def _openmpi(environ: Mapping[str, str]) -> _Read:
    r = _Read("openmpi")
    for field, name, minimum in ((r.rank, "OMPI_COMM_WORLD_RANK", 0), (r.world, "OMPI_COMM_WORLD_SIZE", 1),
                                 (r.local_rank, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
                                 (r.local_world, "OMPI_COMM_WORLD_LOCAL_SIZE", 1)):
        _first(environ, field, (name,), minimum)
        if field.value is None:
            raise LaunchEnvError(f"{name} is not set, though OMPI_COMM_WORLD_RANK is: mpirun sets all four of "
                                 f"OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE")
    return r


def _slurm(environ: Mapping[str, str]) -> _Read:
    r = _Read("slurm")
    _first(environ, r.rank, ("SLURM_PROCID",))
    _first(environ, r.world, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"), minimum=1)
    _first(environ, r.local_rank, ("SLURM_LOCALID",))
    _first(environ, r.node, ("SLURM_NODEID",))
    _first(environ, r.nodes, ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"), minimum=1)
    for field, names in ((r.world, "SLURM_STEP_NUM_TASKS, SLURM_NTASKS, SLURM_NPROCS"),
                         (r.local_rank, "SLURM_LOCALID")):
        if field.value is None:
            raise LaunchEnvError(f"SLURM_PROCID is set but not {names}: srun sets them; launch the ranks with srun")
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        if not _present(environ, name):
            continue
        counts = tasks_per_node(name, environ[name])
        if len(counts) == 1:
            r.local_world.set(counts[0], name)
        elif r.node.value is None:
            raise LaunchEnvError(f"{name}={environ[name]!r} lists {len(counts)} nodes but SLURM_NODEID is not set "
                                 f"to say which is this one")
        elif r.node.value >= len(counts):
            raise LaunchEnvError(f"SLURM_NODEID={r.node.value} but {name}={environ[name]!r} lists {len(counts)} "
                                 f"nodes (0 to {len(counts) - 1})")
        else:
            r.local_world.set(counts[r.node.value], f"{name}[SLURM_NODEID={r.node.value}]")
        break
    return r


def _scheduler(environ: Mapping[str, str]) -> _Read | None:
    if _present(environ, "OMPI_COMM_WORLD_RANK"):
        return _openmpi(environ)
    if _present(environ, "SLURM_PROCID"):
        return _slurm(environ)
    return None


def read_launch_env(environ: Mapping[str, str]) -> LaunchEnv:
    """This process's `LaunchEnv` from the variables in `environ` (``os.environ``, or a dict in a test),
    by the module docstring's precedence; raises `LaunchEnvError` naming the variables when they are
    malformed or contradict each other. Pure: reads only `environ`."""
    if any(_present(environ, n) for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        r = _env_url(environ)
        if None in (r.local_rank.value, r.local_world.value, r.node.value, r.nodes.value):
            sched = _scheduler(environ)  # the same processes: take what it names and the launcher does not
            if sched is not None and (sched.rank.value, sched.world.value) == (r.rank.value, r.world.value):
                for mine, theirs in ((r.local_rank, sched.local_rank), (r.local_world, sched.local_world),
                                     (r.node, sched.node), (r.nodes, sched.nodes)):
                    mine.set(theirs.value, theirs.source, theirs.derived)
    else:
        r = _scheduler(environ) or _Read("none")
        r.rank.set(0, "no launcher", derived=True)
        r.world.set(1, "no launcher", derived=True)
    _fill_and_check(r)
    port = _int(environ, "MASTER_PORT", minimum=1)
    if port is not None and port > 65535:
        raise LaunchEnvError(f"MASTER_PORT={port}: a TCP port is 1 to 65535")
    return LaunchEnv(rank=r.rank.value, world_size=r.world.value, local_rank=r.local_rank.value,
                     local_world_size=r.local_world.value, node_rank=r.node.value, num_nodes=r.nodes.value,
                     master_addr=environ.get("MASTER_ADDR") or None, master_port=port, launcher=r.launcher,
                     elastic_run_id=environ.get("TORCHELASTIC_RUN_ID") or None,
                     agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True")


def _fill_and_check(r: _Read) -> None:
    """Fill what the launcher left unsaid (module docstring), then check the fields against each other."""
    rank, world = r.rank.value, r.world.value
    if rank >= world:
        raise LaunchEnvError(f"{r.rank} is not below {r.world}: ranks run from 0 to the world size - 1")
    if r.nodes.value is not None and r.nodes.value > world:
        raise LaunchEnvError(f"{r.nodes} nodes but {r.world} ranks: every node runs at least one rank")
    if r.local_world.value is None:
        if r.nodes.value not in (None, 1):
            raise LaunchEnvError(f"{r.nodes} nodes but no variable names the ranks on this node: set "
                                 f"LOCAL_WORLD_SIZE (torchrun sets it)")
        r.local_world.set(world, "no variable names the ranks per node: all on one", derived=True)
    local_world = r.local_world.value
    if local_world > world:
        raise LaunchEnvError(f"{r.local_world} ranks on this node but {r.world} in all")
    r.local_rank.set(rank % local_world, "the rank mod the ranks per node", derived=True)
    if r.local_rank.value >= local_world:
        raise LaunchEnvError(f"{r.local_rank} is not below {r.local_world}: local ranks run from 0 to the ranks "
                             f"on the node - 1")
    if local_world == world:  # one node holds every rank
        r.node.set(0, "one node holds every rank", derived=True)
        r.nodes.set(1, "one node holds every rank", derived=True)
    if r.node.value is not None and r.nodes.value is not None and r.node.value >= r.nodes.value:
        raise LaunchEnvError(f"{r.node} is not below {r.nodes}: nodes are numbered from 0")
