"""The launcher's environment, read in one place (megazero/core/launch_env.py), and the device decided in one
(megazero/runtime/device.py).

The same script launched as torchrun, Slurm's srun, Open MPI's mpirun and DeepSpeed's launcher would start it
on a 2-node x 4-rank job gets the same rank, local rank, local world size and device index (on stand-in CUDA
device counts, passed to `compute_device`; inside the subprocess also torch's CUDA count replaced, so the
accelerator and the engine's default device are seen to agree). Malformed or contradicting variables raise
naming them; no other module of megazero names a launcher variable (parsed, as tests/test_layering.py parses
imports).
"""
from __future__ import annotations

import ast
import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

from megazero.core.launch_env import LaunchEnv, LaunchEnvError, read_launch_env, tasks_per_node

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "megazero"
READER = PKG / "core" / "launch_env.py"

NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
         "ROLE_WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR", "MASTER_PORT"}
PREFIXES = ("SLURM_", "OMPI_", "TORCHELASTIC_")
"""The launcher variables: torchrun's, DeepSpeed's launcher's, the rendezvous, and every Slurm / Open MPI /
torchelastic one."""

NODES, PER_NODE = 2, 4
WORLD = NODES * PER_NODE
GPUS = (1, 2, 4, 8)  # stand-in CUDA device counts: one per task (srun --gpus-per-task=1), fewer, as many, more
RANKS = (3, 6)  # node 0 local 3, node 1 local 2


def torchrun_env(rank: int) -> dict:
    """What torchrun's agent sets for worker `rank` (torch/distributed/elastic/agent/server/local_elastic_agent.py)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank % PER_NODE),
            "LOCAL_WORLD_SIZE": str(PER_NODE), "GROUP_RANK": str(rank // PER_NODE), "GROUP_WORLD_SIZE": str(NODES),
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "False"}


def slurm_env(rank: int) -> dict:
    """What srun sets for task `rank` of `srun -N 2 --ntasks-per-node=4` (the batch script exports MASTER_*)."""
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(WORLD), "SLURM_NPROCS": str(WORLD),
            "SLURM_LOCALID": str(rank % PER_NODE), "SLURM_NODEID": str(rank // PER_NODE), "SLURM_NNODES": str(NODES),
            "SLURM_TASKS_PER_NODE": f"{PER_NODE}(x{NODES})", "SLURM_NTASKS_PER_NODE": str(PER_NODE),
            "SLURM_STEP_NUM_TASKS": str(WORLD), "SLURM_STEP_NUM_NODES": str(NODES),
            "SLURM_STEP_TASKS_PER_NODE": f"{PER_NODE}(x{NODES})", "SLURM_JOB_ID": "41",
            "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}


def openmpi_env(rank: int) -> dict:
    """What mpirun sets for rank `rank` of `mpirun -np 8 --map-by ppr:4:node` (the script exports MASTER_*)."""
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(WORLD),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % PER_NODE), "OMPI_COMM_WORLD_LOCAL_SIZE": str(PER_NODE),
            "OMPI_COMM_WORLD_NODE_RANK": str(rank % PER_NODE), "OMPI_UNIVERSE_SIZE": str(WORLD),
            "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}


def deepspeed_env(rank: int) -> dict:
    """What DeepSpeed 0.19.8's launcher (deepspeed/launcher/launch.py) sets for rank `rank`."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank % PER_NODE), "WORLD_SIZE": str(WORLD),
            "CROSS_RANK": str(rank // PER_NODE), "CROSS_SIZE": str(NODES), "LOCAL_SIZE": str(PER_NODE),
            "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}


STYLES = {"torchrun": torchrun_env, "slurm": slurm_env, "openmpi": openmpi_env, "deepspeed": deepspeed_env}

SCRIPT = r"""
import json, os, sys
from unittest import mock

import torch

from megazero.compat import dist_api
from megazero.compat.accelerator import get_accelerator
from megazero.core.launch_env import read_launch_env
from megazero.runtime.device import compute_device

env = read_launch_env(os.environ)
out = {"launcher": env.launcher, "rank": env.rank, "world_size": env.world_size, "local_rank": env.local_rank,
       "local_world_size": env.local_world_size, "node_rank": env.node_rank, "num_nodes": env.num_nodes,
       "master": [env.master_addr, env.master_port],
       "compat": [dist_api.get_rank(), dist_api.get_world_size(), dist_api.get_local_rank()],
       "cpu_accelerator": [get_accelerator().device_name(), get_accelerator().current_device(),
                           get_accelerator().device_count()],
       "devices": {}, "gloo": str(compute_device(env, "gloo", cuda_devices=4))}
for gpus in json.loads(sys.argv[1]):
    device = compute_device(env, "auto", cuda_devices=gpus)
    # this process alone sees `gpus` CUDA devices: the default device and the accelerator follow it
    with mock.patch.object(torch.cuda, "is_available", lambda: True), \
            mock.patch.object(torch.cuda, "device_count", lambda: gpus):
        seen = compute_device(env, "auto")
        accelerator = type(get_accelerator()).__name__
    out["devices"][gpus] = [device.type, device.index, str(seen), accelerator]
print(json.dumps(out))
"""


def _is_launcher_variable(name: str) -> bool:
    return name in NAMES or name.startswith(PREFIXES)


def _clean_environ() -> dict:
    """This process's environment without any launcher variable (or DS_ACCELERATOR), megazero importable."""
    env = {k: v for k, v in os.environ.items() if not _is_launcher_variable(k) and k != "DS_ACCELERATOR"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _launch(variables: dict) -> dict:
    """Run SCRIPT as the launcher with `variables` would start it; its JSON line."""
    p = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(GPUS)], env={**_clean_environ(), **variables},
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("rank", RANKS)
def test_every_launcher_gives_the_same_ranks_and_device(rank):
    local = rank % PER_NODE
    got = {style: _launch(make(rank)) for style, make in STYLES.items()}
    for style, r in got.items():
        assert r["launcher"] == style
        assert (r["rank"], r["world_size"], r["local_rank"], r["local_world_size"]) == (rank, WORLD, local, PER_NODE)
        # Open MPI names no node index, and its ranks could be mapped round-robin over the nodes
        assert (r["node_rank"], r["num_nodes"]) == ((None, None) if style == "openmpi" else (rank // PER_NODE, NODES))
        assert r["master"] == ["node0", 29500]
        assert r["compat"] == [rank, WORLD, local]  # deepspeed.comm before init_distributed
        assert r["cpu_accelerator"] == ["cpu", local, PER_NODE]
        assert r["gloo"] == "cpu"
        assert sorted(r["devices"]) == sorted(str(g) for g in GPUS)
        for gpus in GPUS:
            assert r["devices"][str(gpus)] == ["cuda", local % gpus, f"cuda:{local % gpus}", "CudaAccelerator"]
    facts = {style: {k: r[k] for k in ("rank", "local_rank", "local_world_size", "devices")}
             for style, r in got.items()}
    assert all(f == facts["torchrun"] for f in facts.values()), facts


def test_a_single_process_is_rank_0_of_1_on_the_first_device():
    r = _launch({})
    assert (r["launcher"], r["rank"], r["world_size"], r["local_rank"], r["local_world_size"]) == ("none", 0, 1, 0, 1)
    assert (r["node_rank"], r["num_nodes"], r["master"]) == (0, 1, [None, None])
    assert r["compat"] == [0, 1, 0] and r["cpu_accelerator"] == ["cpu", 0, 1]
    assert [r["devices"][str(g)][:2] for g in GPUS] == [["cuda", 0]] * len(GPUS)


# -- precedence ------------------------------------------------------------------------------------------

def test_torchrun_under_srun_takes_torchruns_variables():
    """srun starts one torchrun per node (SLURM_PROCID = node); torchrun's RANK... describe the worker."""
    env = {**slurm_env(1), "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0",
           "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
           "SLURM_NTASKS_PER_NODE": "1", **torchrun_env(6)}
    got = read_launch_env(env)
    assert (got.launcher, got.rank, got.local_rank, got.local_world_size, got.node_rank) == ("torchrun", 6, 2, 4, 1)


def test_hand_set_rank_takes_the_schedulers_local_facts_when_they_describe_the_same_process():
    """RANK/WORLD_SIZE copied from mpirun's (DeepSpeed's MPI discovery does so): the local rank and size come from
    Open MPI's variables; from a scheduler describing other processes (another rank or world) they do not."""
    same = {**openmpi_env(6), "RANK": "6", "WORLD_SIZE": "8"}
    got = read_launch_env(same)
    assert (got.launcher, got.local_rank, got.local_world_size, got.node_rank) == ("torchrun", 2, 4, None)
    other = {**slurm_env(1), "RANK": "6", "WORLD_SIZE": "8"}  # the Slurm task is another process: one node assumed
    got = read_launch_env(other)
    assert (got.local_rank, got.local_world_size, got.node_rank, got.num_nodes) == (6, 8, 0, 1)


def test_the_more_specific_variable_wins():
    env = {**deepspeed_env(5), "LOCAL_WORLD_SIZE": "4", "LOCAL_SIZE": "8"}  # torchrun's name over DeepSpeed's
    assert (read_launch_env(env).launcher, read_launch_env(env).local_world_size) == ("torchrun", 4)
    step = {**slurm_env(5), "SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_NTASKS_PER_NODE": "8"}  # the step's over the job's
    assert read_launch_env(step).local_world_size == 4
    hetero = {"SLURM_PROCID": "6", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0", "SLURM_NODEID": "3",
              "SLURM_NNODES": "4", "SLURM_TASKS_PER_NODE": "2(x3),1"}
    assert read_launch_env(hetero).local_world_size == 1
    assert tasks_per_node("X", "2(x3),1") == [2, 2, 2, 1] and tasks_per_node("X", "4") == [4]


def test_torchruns_agent_facts_are_read():
    got = read_launch_env({**torchrun_env(0), "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (got.elastic_run_id, got.agent_store) == ("job7", True)
    assert (read_launch_env(deepspeed_env(0)).elastic_run_id, read_launch_env({}).agent_store) == (None, False)
    assert read_launch_env({}) == LaunchEnv()
    assert dataclasses.replace(read_launch_env({"LOCAL_RANK": "0"}), launcher="none") == LaunchEnv()


def test_get_local_rank_works_under_slurm(monkeypatch):
    """deepspeed.comm.get_local_rank and the CPU accelerator under srun (they read LOCAL_RANK /
    LOCAL_WORLD_SIZE only before); no process group."""
    from megazero.compat import dist_api
    from megazero.compat.accelerator import CpuAccelerator

    for name in list(os.environ):
        if _is_launcher_variable(name):
            monkeypatch.delenv(name)
    for name, value in slurm_env(6).items():
        monkeypatch.setenv(name, value)
    assert dist_api.get_local_rank() == 2
    assert (CpuAccelerator().current_device(), CpuAccelerator().device_count()) == (2, PER_NODE)


# -- refusals, naming the variables ----------------------------------------------------------------------

@pytest.mark.parametrize("env, names", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, ["RANK='x'", "whole number"]),
    ({"RANK": "0", "WORLD_SIZE": "0"}, ["WORLD_SIZE='0'", "at least 1"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, ["LOCAL_RANK='-1'"]),
    ({"RANK": "8", "WORLD_SIZE": "8"}, ["RANK=8", "WORLD_SIZE=8"]),
    ({"WORLD_SIZE": "4"}, ["WORLD_SIZE=4", "RANK is not set"]),
    ({"RANK": "1"}, ["RANK=1", "WORLD_SIZE is not set"]),
    ({"LOCAL_RANK": "1"}, ["LOCAL_RANK=1", "all on one"]),
    ({**torchrun_env(4), "LOCAL_RANK": "4"}, ["LOCAL_RANK=4", "LOCAL_WORLD_SIZE=4"]),
    ({**torchrun_env(4), "LOCAL_WORLD_SIZE": "16"}, ["LOCAL_WORLD_SIZE=16", "WORLD_SIZE=8"]),
    ({**torchrun_env(4), "GROUP_RANK": "2"}, ["GROUP_RANK=2", "GROUP_WORLD_SIZE=2"]),
    ({"RANK": "1", "WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2"}, ["GROUP_WORLD_SIZE=2", "LOCAL_WORLD_SIZE"]),
    ({**torchrun_env(0), "MASTER_PORT": "70000"}, ["MASTER_PORT=70000"]),
    ({**torchrun_env(0), "MASTER_PORT": "port"}, ["MASTER_PORT='port'"]),
    ({**slurm_env(1), "SLURM_STEP_TASKS_PER_NODE": "4(x)"}, ["SLURM_STEP_TASKS_PER_NODE='4(x)'", "4(x2)"]),
    ({**slurm_env(1), "SLURM_STEP_TASKS_PER_NODE": "0(x2)"}, ["SLURM_STEP_TASKS_PER_NODE='0(x2)'"]),
    ({**slurm_env(1), "SLURM_NODEID": "2", "SLURM_NNODES": "3", "SLURM_STEP_NUM_NODES": "3"},
     ["SLURM_NODEID=2", "SLURM_STEP_TASKS_PER_NODE='4(x2)'"]),
    ({**{k: v for k, v in slurm_env(1).items() if not k.endswith("_TASKS_PER_NODE")}, "SLURM_NODEID": "2"},
     ["SLURM_NODEID=2", "SLURM_STEP_NUM_NODES=2"]),
    ({"SLURM_PROCID": "0"}, ["SLURM_PROCID", "SLURM_NTASKS"]),
    ({k: v for k, v in slurm_env(1).items() if k != "SLURM_LOCALID"}, ["SLURM_PROCID", "SLURM_LOCALID"]),
    ({**slurm_env(1), "SLURM_PROCID": "9"}, ["SLURM_PROCID=9", "SLURM_STEP_NUM_TASKS=8"]),
    ({k: v for k, v in openmpi_env(1).items() if k != "OMPI_COMM_WORLD_LOCAL_SIZE"}, ["OMPI_COMM_WORLD_LOCAL_SIZE"]),
    ({**openmpi_env(1), "OMPI_COMM_WORLD_LOCAL_RANK": "5"}, ["OMPI_COMM_WORLD_LOCAL_RANK=5",
                                                             "OMPI_COMM_WORLD_LOCAL_SIZE=4"]),
])
def test_bad_variables_are_refused_by_name(env, names):
    with pytest.raises(LaunchEnvError) as err:
        read_launch_env(env)
    for name in names:
        assert name in str(err.value), (name, str(err.value))


def test_the_device_is_the_cpu_without_gpus_or_on_gloo():
    from megazero.runtime.device import compute_device

    env = read_launch_env(torchrun_env(6))
    assert [str(compute_device(env, b, cuda_devices=n)) for b, n in (("auto", 0), ("nccl", 0), ("gloo", 8))] == \
        ["cpu"] * 3
    assert str(compute_device(env, "nccl", cuda_devices=8)) == "cuda:2"
    with pytest.raises(ValueError, match="cuda_devices=-1"):
        compute_device(env, "auto", cuda_devices=-1)


# -- one reader ------------------------------------------------------------------------------------------

def launcher_names_in(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, name) of each launcher variable `path` names: a string literal that is one, or a keyword
    argument called so (``os.environ.update(MASTER_PORT=...)``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_launcher_variable(node.value):
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.keyword) and node.arg is not None and _is_launcher_variable(node.arg):
            found.append((node.value.lineno, node.arg))
    return sorted(found)


def test_only_launch_env_names_the_launcher_variables():
    named = {str(f.relative_to(ROOT)): launcher_names_in(f) for f in sorted(PKG.rglob("*.py")) if f != READER}
    assert {f: n for f, n in named.items() if n} == {}
    assert {"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "LOCAL_SIZE", "MASTER_PORT"} <= \
        {name for _, name in launcher_names_in(READER)}  # the scan sees them where they are


def test_the_scan_finds_planted_reads(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('import os\nrank = os.environ.get("SLURM_PROCID")\nos.environ.update(MASTER_PORT="1")\n'
                       'doc = "RANK is not a read"\n')
    assert launcher_names_in(planted) == [(2, "SLURM_PROCID"), (3, "MASTER_PORT")]
