"""The import rule of docs/architecture.md, enforced by parsing every module's imports (ast).

The folder a module lives in is its layer:

    L0 megazero/core/, planner/, viz/  pure: never imports torch (so neither torch.distributed)
    L1 megazero/runtime/         process groups, collectives, kernel dispatch
    L2 megazero/tensor_parallel/, pipeline/, zero/, activation_checkpoint/
    L3 megazero/models/
    L4 megazero/engine/, checkpoint/, resilience/, toolbox/, run/, data/, compat/ (DeepSpeed's names
       over the engine), and the package __init__ (the top-level API); the DeepSpeed import paths that only re-export (accelerator/,
       comm/, checkpointing/, pipe/, utils/, ops/, runtime/pipe/, runtime/utils/, runtime/zero/, profiling/, monitor/) are L4 too: a
       folder inside a layer's folder may be listed with its own layer (the longest listed prefix wins)

A module may import its own layer and the layers below, never above; megazero never imports
model_specs/, tools/ or benchmarks/. Every import counts, also those inside functions, and the
imports between megazero's modules must form no cycle (an import inside a function hides a cycle
from Python, not from this test). No two modules share a file name.

Inside L4, the engine is a part the trainer is built from: no module of megazero/engine/ imports
megazero/run/, directly or through other modules (`APART`).
"""
from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "megazero"

LAYERS = {
    "core": 0, "planner": 0, "viz": 0, "runtime": 1,
    "tensor_parallel": 2, "context_parallel": 2, "pipeline": 2, "zero": 2, "activation_checkpoint": 2, "moe": 2,
    "models": 3,
    "engine": 4, "checkpoint": 4, "resilience": 4, "toolbox": 4, "run": 4, "data": 4, "ops": 4, "pipe": 4, "utils": 4, "": 4,
    "compat": 4, "accelerator": 4, "comm": 4, "checkpointing": 4, "runtime.pipe": 4, "runtime.utils": 4,
    "runtime.zero": 4, "profiling": 4, "monitor": 4,
}
FORBIDDEN = ("model_specs", "tools", "benchmarks")
# (importer folder, folder): no module of the first reaches a module of the second, directly or through
# other modules, though their layers would allow it (the engine is built by the trainer, never the reverse).
APART = (("engine", "run"),)


def layer_of(mod: str) -> int:
    """The layer of dotted module `mod` (relative to the megazero package): that of the longest
    listed folder prefix (its top folder's, unless a folder inside it is listed)."""
    parts = mod.split(".") if mod else [""]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    raise KeyError(mod)


def module_name(path: pathlib.Path, pkg: pathlib.Path = PKG) -> str:
    rel = path.relative_to(pkg).with_suffix("")
    return ".".join(p for p in rel.parts if p != "__init__")


def known_modules(pkg: pathlib.Path = PKG) -> set[str]:
    return {module_name(f, pkg) for f in pkg.rglob("*.py")}


def imports_of(path: pathlib.Path, pkg: pathlib.Path = PKG):
    """Yield (imported module, absolute and dotted, lineno) for every import in `path`, at any depth.

    `from megazero.a import b` yields megazero.a.b when b is a module, else megazero.a."""
    modules = known_modules(pkg)
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path, pkg)
    pkg_parts = me.split(".") if me else []
    if path.name != "__init__.py":
        pkg_parts = pkg_parts[:-1]
    for node in sorted((n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))),
                       key=lambda n: (n.lineno, n.col_offset)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(pkg_parts[: len(pkg_parts) - node.level + 1] + ([node.module] if node.module else []))
                mod = "megazero" + ("." + base if base else "")
            else:
                mod = node.module or ""
            if mod == "megazero" or mod.startswith("megazero."):
                rel = mod[len("megazero."):] if mod != "megazero" else ""
                for alias in node.names:
                    sub = f"{rel}.{alias.name}" if rel else alias.name
                    yield ("megazero." + sub if sub in modules else mod), node.lineno
            else:
                yield mod, node.lineno


def violations(path: pathlib.Path, pkg: pathlib.Path = PKG) -> list[str]:
    """Every import of `path` that breaks the rule, as readable lines."""
    me = module_name(path, pkg)
    mine = layer_of(me)
    bad = []
    for target, line in imports_of(path, pkg):
        top = target.split(".")[0]
        if top in FORBIDDEN:
            bad.append(f"{path}:{line} imports {target}: megazero never imports {top}/")
        if mine == 0 and top == "torch":
            bad.append(f"{path}:{line}: L0 module {me} imports {target}; L0 (megazero/core/, planner/, viz/) never imports torch")
        if top != "megazero":
            continue
        sub = target[len("megazero."):] if target != "megazero" else ""
        try:
            theirs = layer_of(sub)
        except KeyError:
            bad.append(f"{path}:{line} imports unknown megazero module {target}")
            continue
        if theirs > mine:
            bad.append(f"{path}:{line}: {me or 'megazero'} (L{mine}) imports {target} (L{theirs}); "
                       f"a module may import only its own layer and those below")
    return bad


def import_graph(pkg: pathlib.Path = PKG) -> nx.DiGraph:
    """Module -> module edges of every import between megazero's modules (function-level ones included)."""
    graph = nx.DiGraph()
    for f in sorted(pkg.rglob("*.py")):
        me = "megazero" + ("." + module_name(f, pkg) if module_name(f, pkg) else "")
        graph.add_node(me)
        for target, _ in imports_of(f, pkg):
            if target.startswith("megazero") and target != me:
                graph.add_edge(me, target)
    return graph


def apart_violations(pkg: pathlib.Path = PKG, apart=APART) -> list[str]:
    """Every module of an `apart` importer folder that reaches a module of the folder it stays apart from
    (any import chain, function-level imports included), as readable lines with the chain."""
    graph = import_graph(pkg)

    def folder(node: str) -> str:
        return node[len("megazero."):].split(".")[0] if node.startswith("megazero.") else ""

    bad = []
    for importer, kept_out in apart:
        for node in sorted(n for n in graph if folder(n) == importer):
            for target in sorted(nx.descendants(graph, node)):
                if folder(target) == kept_out:
                    chain = " -> ".join(nx.shortest_path(graph, node, target))
                    bad.append(f"{node} reaches {target} ({chain}): megazero/{importer}/ never imports "
                               f"megazero/{kept_out}/")
    return bad


def cycles(pkg: pathlib.Path = PKG) -> list[list[str]]:
    """Import cycles, each as its modules in order. A package's __init__ re-exporting its own
    submodules is not a cycle unless a submodule imports the package back."""
    return [sorted(c) for c in nx.simple_cycles(import_graph(pkg))]


FILES = sorted(PKG.rglob("*.py"))


def test_every_module_has_a_layer():
    unknown = [module_name(f) for f in FILES if module_name(f).split(".")[0] not in LAYERS]
    assert layer_of("runtime.pipe.topology") == 4 and layer_of("runtime.comm") == 1 and layer_of("") == 4
    assert not unknown, f"put these modules in a layer's folder (see tests/test_layering.py): {unknown}"


def test_no_two_modules_share_a_name():
    names: dict[str, list[str]] = {}
    for f in FILES:
        if f.name not in ("__init__.py", "__main__.py"):
            names.setdefault(f.name, []).append(str(f.relative_to(ROOT)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_respect_layers(path):
    assert violations(path) == []


def test_no_import_cycles():
    assert cycles() == []


def test_engine_never_imports_run():
    assert apart_violations() == []


def _plant(tmp_path, files: dict[str, str]) -> pathlib.Path:
    pkg = tmp_path / "megazero"
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def test_rule_catches_upward_and_forbidden_imports(tmp_path):
    pkg = _plant(tmp_path, {
        "__init__.py": "", "core/__init__.py": "", "runtime/__init__.py": "", "pipeline/__init__.py": "",
        "engine/__init__.py": "x = 1\n",
        "core/topology.py": "import torch.distributed as dist\nfrom megazero.engine import x\n",
        "core/schedules.py": "def f():\n    from ..runtime import comm\n\nimport tools.planner\n",
        "runtime/comm.py": "",
        "pipeline/executor.py": "from megazero.core import schedules\nfrom megazero.runtime import comm\n",
    })
    found = violations(pkg / "core" / "topology.py", pkg)
    assert len(found) == 2 and "never imports torch" in found[0] and "megazero.engine (L4)" in found[1]
    found = violations(pkg / "core" / "schedules.py", pkg)  # the function-level upward import counts
    assert len(found) == 2 and "megazero.runtime.comm (L1)" in found[0] and "tools/" in found[1]
    assert violations(pkg / "pipeline" / "executor.py", pkg) == []


def test_rule_catches_a_function_level_cycle(tmp_path):
    pkg = _plant(tmp_path, {
        "__init__.py": "", "core/__init__.py": "", "models/__init__.py": "",
        "core/spec.py": "def build():\n    from megazero.models import lm\n    return lm\n",
        "models/lm.py": "from megazero.core.spec import build\n",
    })
    assert cycles(pkg) == [["megazero.core.spec", "megazero.models.lm"]]
    (pkg / "core" / "spec.py").write_text("def build():\n    return None\n")
    assert cycles(pkg) == []


def test_rule_catches_engine_reaching_run(tmp_path):
    pkg = _plant(tmp_path, {
        "__init__.py": "", "engine/__init__.py": "", "run/__init__.py": "", "checkpoint/__init__.py": "",
        "run/train.py": "from megazero.engine import factories\n",
        "engine/factories.py": "",
        "engine/checkpointing.py": "def save():\n    from megazero.checkpoint import sharded\n",
        "checkpoint/sharded.py": "import megazero.run.train\n",
    })
    found = apart_violations(pkg)  # through checkpoint/, engine reaches run.train
    assert len(found) == 1, found
    assert found[0].startswith("megazero.engine.checkpointing reaches megazero.run.train (megazero.engine."
                               "checkpointing -> megazero.checkpoint.sharded -> megazero.run.train)")
    (pkg / "checkpoint" / "sharded.py").write_text("")
    assert apart_violations(pkg) == []
    (pkg / "engine" / "factories.py").write_text("from megazero.run import train\n")  # directly
    assert len(apart_violations(pkg)) == 1


# -- DeepSpeed's names: import paths that only re-export, compat/ as views ---------------------------------------

DEEPSPEED_PATHS = ("accelerator", "comm", "checkpointing", "monitor", "profiling", "pipe", "utils", "ops",
                   "runtime.pipe", "runtime.utils", "runtime.zero")
"""The folders at DeepSpeed's import paths outside compat/. zero/ and moe/ hold DeepSpeed's names next to
megazero's own and are not among them; megazero/__init__.py and runtime/__init__.py are megazero's packages."""


def reexport_violations(path: pathlib.Path) -> list[str]:
    """What a module at a DeepSpeed import path holds besides a docstring, imports and `__all__`: each
    other top-level statement, as a readable line (every translation lives in compat/)."""
    bad = []
    for i, node in enumerate(ast.parse(path.read_text(), filename=str(path)).body):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            continue
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            continue
        bad.append(f"{path}:{node.lineno}: {type(node).__name__} {getattr(node, 'name', '')}".rstrip()
                   + "; a DeepSpeed import path holds only imports and __all__ (put the code in compat/)")
    return bad


def test_deepspeed_import_paths_only_reexport():
    files = []
    for folder in DEEPSPEED_PATHS:
        assert LAYERS[folder] == 4 and (PKG / folder.replace(".", "/") / "__init__.py").is_file(), folder
        files += sorted((PKG / folder.replace(".", "/")).rglob("*.py"))
    assert len(files) >= 18  # every __init__ of the 11 folders and their subpackages
    assert [v for f in files for v in reexport_violations(f)] == []


def test_the_reexport_rule_catches_a_definition(tmp_path):
    ok = tmp_path / "ok.py"
    ok.write_text('"""doc"""\nfrom x import y\n__all__ = [n for n in dir() if not n.startswith("_")]\n')
    assert reexport_violations(ok) == []
    bad = tmp_path / "bad.py"
    bad.write_text('"""doc"""\nfrom x import y\nZ = 1\n\n\nclass FusedLamb:\n    pass\n')
    found = reexport_violations(bad)
    assert len(found) == 2 and "Assign" in found[0] and "ClassDef FusedLamb" in found[1]


COMPAT_STATE_ALLOWED = {
    "engines.py": "the one registry: the live engines (weak references) and DeepSpeed's per-process settings",
}


def process_state(path: pathlib.Path) -> list[str]:
    """Process-wide state a module keeps: functions cached for the process (`functools.cache`, `lru_cache`)
    and objects made at import (a module-level call other than `logging.getLogger`)."""
    found = []
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                name = ast.unparse(d.func if isinstance(d, ast.Call) else d)
                if name.split(".")[-1] in ("cache", "lru_cache"):
                    found.append(f"{path.name}:{node.lineno}: {node.name} is cached for the process")
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Call) and ast.unparse(value.func) != "logging.getLogger":
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:60]} is made at import")
    return found


def test_compat_keeps_no_state_of_its_own_but_the_registry():
    """compat/ holds no rank map, RNG tracker or comms logger of its own: the one process-wide state is
    compat/engines.py's registry, and the classes that answer DeepSpeed's rank-map, RNG-stream and
    comms-logger queries are the views that tests/test_compat_views.py checks delegate."""
    files = sorted((PKG / "compat").glob("*.py"))
    assert [s for f in files if f.name not in COMPAT_STATE_ALLOWED for s in process_state(f)] == []
    assert process_state(PKG / "compat" / "engines.py") != []  # the rule sees the registry itself
    views = {"get_coord": {"ProcessTopology"}, "fork": {"CudaRNGStatesTracker"}, "append": {"CommsLogger"},
             "record_time": set(), "axis_groups": set(), "generator": set()}
    defined: dict[str, set] = {name: set() for name in views}
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name in defined:
                        defined[item.name].add(node.name)
    assert defined == views
