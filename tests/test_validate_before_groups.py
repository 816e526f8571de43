"""Validate, then build: every refusal comes before megazero creates any process group.

- The whole bad-config corpus (tests/test_config_errors.py) and the refusals that need the model spec or
  what `initialize` was given run through `megazero.initialize` with torch.distributed's
  `init_process_group` and `new_group` counted: each stops with a ConfigError naming its key on the first
  line, and no group was created.
- The engine raises no ConfigError (parsed, ast), and after `init_distributed` its build calls no refusal of
  `megazero.core.config`: the refusals live in core/config (`spec_checks` while the config loads,
  `initialize_checks` at the top of `initialize`). The one check left after the groups exist is a
  PipelineModule built for another rank's stage (`megazero/pipeline/stage_agreement.py`, tested in
  tests/test_user_pipeline_module.py).
"""
from __future__ import annotations

import ast
import os
import json
import pathlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import megazero
from megazero.core.config import ConfigError, load_config
from megazero.core.launch_env import LaunchEnvError
from tests.test_config_errors import CASES

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENGINE = ROOT / "megazero" / "engine"


class GroupCreated(Exception):
    """Raised by the patched torch.distributed in place of creating a group."""


@pytest.fixture
def groups(monkeypatch):
    """Counts every call of torch.distributed's init_process_group and new_group (none is created: a
    call raises GroupCreated), in a launched world of 2 ranks (WORLD_SIZE, MASTER_ADDR / MASTER_PORT: with
    one rank megazero would create no torch group at all, so a late refusal would go unseen; a test may set
    another WORLD_SIZE)."""
    calls = []
    threads = torch.get_num_threads()  # init_distributed sets it, should a control get that far

    def counted(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise GroupCreated(name)
        return call

    for name in ("init_process_group", "new_group"):
        monkeypatch.setattr(dist, name, counted(name))
    for var in list(os.environ):  # no launcher of the calling shell leaks in (torchrun, Slurm, Open MPI, ...)
        if var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "CROSS_RANK", "CROSS_SIZE",
                   "LOCAL_SIZE") or var.startswith(("SLURM_", "OMPI_COMM_WORLD_")):
            monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")  # rank 0 of the launched world: a launcher sets RANK with WORLD_SIZE
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    assert not dist.is_initialized()
    yield calls
    torch.set_num_threads(threads)


def _refused(groups, key: str, *words: str, error=ConfigError, **initialize_kwargs) -> str:
    """`megazero.initialize(**initialize_kwargs)` raises an `error` (a ConfigError, or the launcher
    environment's LaunchEnvError) whose first line names `key` and which says each of `words`, before any
    process group; returns the message."""
    with pytest.raises(error) as info:
        megazero.initialize(**initialize_kwargs)
    msg = str(info.value)
    assert key in msg.splitlines()[0], msg
    for word in words:
        assert word in msg, msg
    assert groups == [] and not dist.is_initialized(), (groups, msg)
    return msg


def _source(tmp_path, source):
    """A corpus case's source as initialize takes it: a file path, or {} for the defaults."""
    if source is None:
        return {}
    path = tmp_path / ("case.yaml" if isinstance(source, str) else "case.json")
    path.write_text(source if isinstance(source, str) else json.dumps(source))
    return str(path)


@pytest.mark.parametrize("case_id,source,overrides,world_size,expected", CASES, ids=[c[0] for c in CASES])
def test_the_bad_config_corpus_creates_no_process_group(tmp_path, monkeypatch, groups, case_id, source, overrides,
                                                        world_size, expected):
    """The corpus through `initialize` on a launched world of `world_size` ranks (the launcher's WORLD_SIZE;
    2 where the case has none): the same refusal as `load_config`'s, naming the same key first."""
    if world_size is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
    if world_size is not None and world_size < 1:  # a launcher's impossible world: refused as its variable
        _refused(groups, "WORLD_SIZE", "at least 1", error=LaunchEnvError, config=_source(tmp_path, source),
                 overrides=overrides)
        return
    _refused(groups, expected[0], *expected[1:], config=_source(tmp_path, source), overrides=overrides)


GPT = "configs/debug_gpt.yaml"
ONE_RANK = ["parallel.pp=1", "parallel.tp=1", "data.path=null", "train.global_batch_size=null"]
MOE = {"model": {"spec": "model_specs/llama.py:debug-moe"}, "train": {"micro_batch_size": 1}}

SPEC_CASES = [  # (id, config, overrides, world size, the key, words): refusals that need the model spec
    ("ep-without-moe", GPT, ONE_RANK + ["parallel.ep=2"], 2, "parallel.ep=2", ["expert parallelism needs"]),
    ("partition-too-many-stages", GPT, ["parallel.pp=8", "parallel.tp=1", "model.layers=2", "data.path=null",
                                        "train.global_batch_size=16"], 8,
     "pipeline.partition", ["cannot split 4 layers into num_stages=8"]),
    ("cp-seq-len", GPT, ONE_RANK + ["parallel.cp=4", "model.seq_len=36"], 4, "model.seq_len",
     ["must be a multiple of 8 = 2 x parallel.cp"]),
    ("cp-dropout", GPT, ONE_RANK + ["parallel.cp=2", "model.dropout=0.1"], 2, "model.dropout", ["parallel.cp=2"]),
    ("moe-drop-without-capacity", MOE, ["model.moe.drop_tokens=true"], 2, "model.moe.drop_tokens",
     ["no capacity"]),
    ("moe-no-drop-with-capacity", MOE, ["model.moe.drop_tokens=false", "model.moe.capacity_factor=1.5"], 2,
     "model.moe.drop_tokens", ["no dropping has no capacity"]),
    ("moe-sequence-parallel", MOE, ["parallel.tp=2", "parallel.sequence_parallel=true"], 2,
     "parallel.sequence_parallel", ["not supported with model.moe"]),
    ("hpz-across-nodes", GPT, ["parallel.pp=1", "parallel.tp=2", "parallel.ranks_per_node=4", "data.path=null",
                               "zero.stage=3", "zero.hpz_partition_size=4", "train.global_batch_size=null"], 8,
     "zero.hpz_partition_size=4", ["its groups span nodes of 4 ranks"]),
    ("no-model", {}, [], 2, "model.spec", ["no model given"]),
    ("flops-profiler-on-a-spec", GPT, ONE_RANK + ["log.flops_profiler.enabled=true"], 2,
     "log.flops_profiler.enabled", ["plain nn.Module"]),
]


@pytest.mark.parametrize("case_id,config,overrides,world,key,words", SPEC_CASES, ids=[c[0] for c in SPEC_CASES])
def test_refusals_that_need_the_spec_create_no_process_group(monkeypatch, groups, case_id, config, overrides, world,
                                                             key, words):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    _refused(groups, key, *words, config=config, overrides=overrides)


def test_a_spec_named_to_initialize_is_checked_like_the_configs_own(groups):
    _refused(groups, "parallel.ep=2", "expert parallelism needs", model="model_specs/gpt.py:debug",
             config={"train": {"micro_batch_size": 1}}, overrides=["parallel.ep=2"])


def test_what_initialize_is_given_is_refused_before_any_process_group(monkeypatch, tmp_path, groups):
    """Two configs, a Config with overrides, an mpu of another layout, a client optimizer the ZeRO optimizer
    cannot run or with a model not built yet, and what a built model cannot run with."""
    from megazero.core.config.initialize_checks import BuiltModel, check_model
    from megazero.moe.layer import MoE
    from megazero.pipeline.pipeline_module import PipelineModule

    def net():
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))

    ds = {"train_micro_batch_size_per_gpu": 1}
    _refused(groups, "initialize", "given twice", config=ds, config_params=ds, model=net())
    cfg = load_config(ds, world_size=1)
    _refused(groups, "overrides", "a Config is used as it is", config=cfg, overrides=["train.steps=2"], model=net())

    class Mpu:
        def get_tensor_model_parallel_world_size(self):
            return 2

    _refused(groups, "initialize(mpu=...)", "differs", config=ds, model=net(), mpu=Mpu())
    model = net()
    _refused(groups, "initialize(optimizer=RMSprop)", "Adam, AdamW", config=ds, model=model,
             optimizer=torch.optim.RMSprop(model.parameters()))
    _refused(groups, "initialize(optimizer=SGD(dampening=0.5))", "dampening=0", config=ds, model=model,
             optimizer=lambda p: torch.optim.SGD(p, lr=0.1, dampening=0.5))
    _refused(groups, "initialize(optimizer=...)", "optimizer section", model="model_specs/gpt.py:debug",
             config={"train": {"micro_batch_size": 1}}, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    _refused(groups, "activation_checkpointing.policy=full", "already built", config=ds, model=net(),
             overrides=["activation_checkpointing.policy=full"])
    _refused(groups, "resilience.silent_error_interval", "cannot replay", config=ds, model=net(),
             overrides=["resilience.silent_error_interval=5"])
    two_stages = PipelineModule([nn.Linear(4, 4), nn.Linear(4, 4)], num_stages=2, stage=0)
    _refused(groups, "parallel.pp=1", "num_stages=2", config=ds, model=two_stages, overrides=["parallel.pp=1"])
    _refused(groups, "parallel.tp=2, parallel.pp=1", "plain nn.Module runs with tp = pp = 1", config=ds, model=net(),
             overrides=["parallel.tp=2"])
    _refused(groups, "parallel.cp=2", "not a built Sequential", config=ds, model=net(), overrides=["parallel.cp=2"])
    _refused(groups, "parallel.ep=2", "megazero.moe.layer.MoE", config=ds, model=net(), overrides=["parallel.ep=2"])
    mixed = nn.Sequential(MoE(4, nn.Linear(4, 4), num_experts=2, ep_size=2), MoE(4, nn.Linear(4, 4), num_experts=2))
    _refused(groups, "MoE layers with ep_size [1, 2]", "same ep_size", config=ds, model=mixed)
    with pytest.raises(GroupCreated):  # the control: what initialize accepts reaches init_process_group
        megazero.initialize(config=ds, model=net())
    assert groups == ["init_process_group"]
    with pytest.raises(ValueError, match="BuiltModel.kind='graph'"):  # the checks' own argument
        check_model(cfg, BuiltModel("graph"))


def _raises_config_error(node: ast.AST) -> bool:
    """Whether `node` is ``raise ConfigError(...)`` (or ``raise <module>.ConfigError(...)``, or re-raises
    a ConfigError class)."""
    if not isinstance(node, ast.Raise) or node.exc is None:
        return False
    exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
    return (isinstance(exc, ast.Name) and exc.id == "ConfigError") or (
        isinstance(exc, ast.Attribute) and exc.attr == "ConfigError")


def test_the_engine_raises_no_config_error():
    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in sorted(ENGINE.rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text())) if _raises_config_error(node)]
    assert found == [], f"refusals belong in megazero/core/config (before any process group): {found}"
    assert _raises_config_error(ast.parse("raise ConfigError('x')").body[0])  # the detector sees one


def _core_config_names(tree: ast.Module) -> set[str]:
    """The names a module imports from megazero.core.config or its submodules."""
    return {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("megazero.core.config") for alias in node.names}


def test_after_the_groups_the_build_calls_no_refusal():
    """Rule: in `initialize_from_config`, every call at or after `init_distributed` to a name from
    megazero.core.config is one that refuses nothing (`topology_of`: the rank grid of a resolved config),
    and the refusals (`check_model`; `take_over`, which asks `client_update_rule`; `check_installed`) come
    before it. The other functions of the build that core/config names reach are factories.py's, which
    import only `client_update_rule`, called by `take_over` alone."""
    source = (ENGINE / "__init__.py").read_text()
    tree = ast.parse(source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "initialize_from_config")
    calls = [(n.lineno, n.func.id) for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    start = min(line for line, name in calls if name == "init_distributed")
    core = _core_config_names(tree)
    after = {name for line, name in calls if line >= start and name in core}
    assert after <= {"topology_of"}, after
    for refusal in ("check_model", "take_over", "check_installed"):
        lines = [line for line, name in calls if name == refusal]
        assert lines and max(lines) < start, (refusal, lines, start)
    factories = ast.parse((ENGINE / "factories.py").read_text())
    assert _core_config_names(factories) == {"Config", "client_update_rule"}
    users = {fn.name for fn in ast.walk(factories) if isinstance(fn, ast.FunctionDef)
             and any(isinstance(n, ast.Name) and n.id == "client_update_rule" for n in ast.walk(fn))}
    assert users == {"take_over"}, users
