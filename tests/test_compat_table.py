"""The table of DeepSpeed's API in docs/deepspeed-migration.md ("DeepSpeed's API, name by name") cannot
drift: every name it lists resolves under megazero at DeepSpeed's path to something callable (or, for
`utils.logger`, a logger; for an engine attribute, a method, property or attribute the engine sets; for a
config section, a DeepSpeed key rule with a megazero target or a refusal), every test it names exists and
uses the name in its code (found with ast: an identifier, attribute, import or string constant, never a
comment or a docstring), every "refused" name refuses when called, and every name of DeepSpeed's documented
API that megazero answers for is in the table."""
import ast
import functools
import inspect
import logging
import pathlib
import re
import sys
import textwrap

import pytest

import megazero

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "deepspeed-migration.md").read_text()

# DeepSpeed's documented API that the compatibility layer answers for (namespaces of its API reference and
# tutorials); each must be a row of the table
REQUIRED = [
    "initialize", "add_config_arguments", "init_distributed", "engine.is_gradient_accumulation_boundary",
    "engine.set_gradient_accumulation_boundary", "engine.fp16_enabled", "engine.bfloat16_enabled",
    "engine.zero_optimization_stage", "engine.global_rank", "engine.world_size", "engine.dp_world_size",
    "engine.mp_world_size", "engine.global_steps", "engine.global_samples", "engine.module", "engine.optimizer",
    "engine.lr_scheduler", "engine.monitor", "engine.grid", "accelerator.get_accelerator",
    "comm.log_summary", "config comms_logger", "zero.Init", "zero.GatheredParameters",
    "zero.register_external_parameter", "zero.TiledLinear",
    "runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live",
    "runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_cold",
    "runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live",
    "runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_cold",
    "utils.safe_get_full_fp32_param", "utils.safe_get_full_grad", "utils.safe_get_full_optimizer_state",
    "utils.safe_get_local_fp32_param", "utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint",
    "utils.log_dist", "utils.logger", "utils.RepeatingLoader", "checkpointing.configure", "checkpointing.checkpoint",
    "checkpointing.get_cuda_rng_tracker", "checkpointing.model_parallel_cuda_manual_seed", "pipe.PipelineModule",
    "pipe.LayerSpec", "pipe.TiedLayerSpec", "runtime.pipe.topology.ProcessTopology",
    "runtime.pipe.topology.PipeModelDataParallelTopology", "runtime.utils.set_random_seed", "ops.adam.FusedAdam",
    "ops.adam.DeepSpeedCPUAdam", "ops.lamb.FusedLamb", "config tensorboard", "config csv_monitor", "config wandb",
    "config flops_profiler", "config wall_clock_breakdown", "config memory_breakdown", "moe.layer.MoE",
    "moe.utils.split_params_into_different_moe_groups_for_optimizer", "moe.utils.is_moe_param",
]

NAMESPACES = ("engine", "accelerator", "comm", "zero", "utils", "checkpointing", "pipe", "runtime", "ops", "profiling",
              "moe")


def table(doc: str, header: str) -> str:
    """The markdown table whose header row starts with `header`, up to the blank line after it."""
    start = doc.index("| " + header)
    return doc[start:].split("\n\n", 1)[0]


def rows(doc: str = DOC):
    """(names, status, test paths) of each row of the name-by-name table. A name without a namespace
    continues the first name of its cell (`utils.safe_get_full_grad`, `safe_get_local_grad`); in a row
    starting with "config", each name is a DeepSpeed config section."""
    section = doc.split("## DeepSpeed's API, name by name", 1)[1]
    out = []
    for line in table(section, "DeepSpeed name").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) != 3 or cells[0] == "DeepSpeed name":
            continue
        tokens = [t for t in re.findall(r"`([^`]+)`", cells[0]) if not t.endswith(".py")]
        if cells[0].startswith("config "):
            names = ["config " + t for t in tokens]
        else:
            prefix = tokens[0].rsplit(".", 1)[0] + "." if "." in tokens[0] else ""
            names = [t if t == tokens[0] or t.split(".")[0] in NAMESPACES else prefix + t for t in tokens]
        out.append((names, cells[1], re.findall(r"`(tests/[^`]+\.py)`", cells[2])))
    return out


ROWS = rows()
NAMES = [n for names, _, _ in ROWS for n in names]


def _assigned_in_init(cls) -> set[str]:
    """The attributes `cls.__init__` assigns (`self.x = ...`, `self.x, self.y = ...`, `self.x: T = ...`)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names


def _engine_member(attr: str):
    """The member `attr` of ModuleEngine or PipelineEngine: a method or property (looked up statically),
    or the name of an attribute the constructor sets."""
    from megazero.engine import ModuleEngine, PipelineEngine

    for cls in (ModuleEngine, PipelineEngine):
        try:
            return inspect.getattr_static(cls, attr)
        except AttributeError:
            pass
    for cls in (ModuleEngine, PipelineEngine):
        if attr in _assigned_in_init(cls):
            return attr
    raise AttributeError(f"neither engine has {attr!r}")


def _resolve(name: str):
    """The object `name` denotes under megazero: for "config X", the DeepSpeed key rules of section X."""
    if name.startswith("config "):
        from megazero.core.config import deepspeed_keys

        key = name.split(" ", 1)[1]
        return [r for r in deepspeed_keys.RULES if r.ds == key or r.ds.startswith(key + ".")]
    if name.startswith("engine."):
        return _engine_member(name.split(".", 1)[1])
    obj = megazero
    for part in re.split(r"\.(?![^(]*\))", name):
        obj = getattr(obj, part[:-2])() if part.endswith("()") else getattr(obj, part)
    return obj


def _check_kind(name: str, obj) -> None:
    """`obj` is what a DeepSpeed user calls or reads under `name`."""
    if name.startswith("config "):
        from megazero.core.config.schema import all_keys

        assert obj, f"{name}: no DeepSpeed key rule"
        keys = set(all_keys())
        for rule in obj:  # each key goes to a real megazero key, or has none (a no-op or a refusal)
            assert rule.target is None or rule.target in keys or not rule.target[0].isalpha(), (name, rule)
    elif name.startswith("engine."):
        member = obj
        assert isinstance(member, (property, str, staticmethod, classmethod)) or callable(member), (name, member)
    elif name == "utils.logger":
        assert isinstance(obj, logging.Logger), obj
    elif obj is None and name.startswith("accelerator.get_accelerator()."):
        # the CPU accelerator's Stream and Event are None, as DeepSpeed's CPU accelerator's: a property
        accelerator = megazero.accelerator.get_accelerator()
        assert isinstance(inspect.getattr_static(type(accelerator), leaf(name)), property), name
    else:
        assert callable(obj), f"{name} resolves to {obj!r}, which is not callable"


@pytest.mark.parametrize("name", NAMES)
def test_every_listed_name_resolves_to_what_deepspeed_users_call(name):
    _check_kind(name, _resolve(name))


@functools.cache
def code_words(path: str) -> frozenset[str]:
    """Every identifier, attribute, imported name, keyword argument and word of a string constant in the
    code of `path` (ast: comments and docstrings are not code)."""
    tree = ast.parse((ROOT / path).read_text())
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.alias):
            words.update(node.name.split("."))
        elif isinstance(node, ast.ImportFrom) and node.module:
            words.update(node.module.split("."))
        elif isinstance(node, ast.keyword) and node.arg:
            words.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.update(re.findall(r"\w+", node.value))  # a config key, or a script run in a subprocess
    return frozenset(words)


def leaf(name: str) -> str:
    """The part of a table name a test's code uses: `get_accelerator().device_name` -> device_name."""
    return re.split(r"[. ]", name.replace("()", ""))[-1]


@pytest.mark.parametrize("names, status, tests", ROWS, ids=[r[0][0] for r in ROWS])
def test_each_row_names_a_test_whose_code_uses_it(names, status, tests):
    """Every name of a row is used in the code of one of the tests the row names (a call, an attribute,
    an import or a config key), not only mentioned in a comment or docstring."""
    assert status.split(":")[0].split(" ")[0].rstrip(";,") in ("same", "differs", "refused"), status
    assert tests and all((ROOT / t).is_file() for t in tests), (names, tests)
    words = frozenset().union(*(code_words(t) for t in tests))
    unused = [name for name in names if leaf(name) not in words]
    assert unused == [], f"{tests} do not use {unused} in their code (listed as {status!r})"


def test_a_name_only_in_a_comment_or_docstring_is_not_used(tmp_path, monkeypatch):
    """The check above reads code: a comment or a docstring naming a function does not count."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "t.py").write_text('"""safe_get_full_grad is tested here."""\n'
                                   "# get_accelerator() too\n"
                                   "def test_x():\n    '''log_dist'''\n    return megazero.utils.safe_get_local_grad(p)\n")
    words = code_words.__wrapped__("t.py")
    assert "safe_get_local_grad" in words and "megazero" in words
    assert not {"safe_get_full_grad", "get_accelerator", "log_dist"} & words


def _refusal(name: str):
    """Call a refused name the way a DeepSpeed user would."""
    if name == "config comet":
        from megazero.core.config import load_config

        return load_config({"train_batch_size": 8, "comet": {"enabled": True}})
    obj = _resolve(name)
    return obj([]) if inspect.isclass(obj) else obj(None)


REFUSED = [n for names, status, _ in ROWS if status.startswith("refused") for n in names]


@pytest.mark.parametrize("name", REFUSED)
def test_every_refused_name_refuses_with_a_reason(name):
    from megazero.core.config.errors import ConfigError

    with pytest.raises((NotImplementedError, ConfigError)) as err:
        _refusal(name)
    assert len(str(err.value)) > 30, str(err.value)  # the refusal says why and what to use instead


def test_the_table_has_its_refusals():
    assert set(REFUSED) == {"accelerator.set_accelerator", "ops.lamb.FusedLamb", "config comet"}


def test_every_required_name_is_in_the_table():
    missing = [n for n in REQUIRED if n not in NAMES]
    assert missing == [], missing


def test_the_gradient_semantics_table_names_real_tests():
    """The second table (PyTorch's gradient semantics at the engine's edge): each row's test function exists."""
    found = re.findall(r"`(tests/[^`:]+\.py)::(\w+)`", table(DOC, "PyTorch's gradient semantics"))
    assert len(found) >= 10
    for path, func in found:
        functions = {n.name for n in ast.walk(ast.parse((ROOT / path).read_text())) if isinstance(n, ast.FunctionDef)}
        assert func in functions, (path, func)
