"""The import rule of ../shared/DESIGN.md, enforced by parsing every module's imports (ast).

A module may import its own layer and the layers below, never above; megazero never imports
model_specs/, tools/ or benchmarks/; L0 modules never import torch.distributed.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "megazero"

# Longest matching prefix wins. Dotted module names relative to the megazero package.
LAYERS = {
    "config": 0, "topology": 0, "pipeline.instructions": 0, "pipeline.schedules": 0,
    "pipeline.simulate": 0, "pipeline.partition": 0, "pipeline.csv_schedule": 0,
    "zero.flat_buffer": 0, "kernels.reference": 0, "planner": 0,
    "parallel_context": 1, "comm": 1, "kernels": 1,
    "tensor_parallel": 2, "pipeline": 2, "zero": 2, "activation_checkpoint": 2, "memory": 2,
    "models": 3, "spec": 3,
    "pipeline.executor": 4, "engine": 4, "data": 4, "checkpoint": 4, "train": 4, "trace": 4,
    "metrics": 4, "launch": 4, "trainer_loop": 4, "": 4,  # the package __init__ may expose the top-level API
}
FORBIDDEN = ("model_specs", "tools", "benchmarks")


def layer_of(mod: str) -> int:
    parts = mod.split(".")
    for i in range(len(parts), -1, -1):
        key = ".".join(parts[:i])
        if key in LAYERS:
            return LAYERS[key]
    raise KeyError(mod)


def module_name(path: pathlib.Path, pkg: pathlib.Path = PKG) -> str:
    rel = path.relative_to(pkg).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def imports_of(path: pathlib.Path, pkg: pathlib.Path = PKG):
    """Yield (imported module, absolute and dotted, lineno) for every import in `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path, pkg)
    pkg_parts = me.split(".") if me else []
    if path.name != "__init__.py":
        pkg_parts = pkg_parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[: len(pkg_parts) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target] if node.module else [".".join(base + [a.name]) for a in node.names]
                for n in names:
                    yield "megazero." + n if n else "megazero", node.lineno
            else:
                mod = node.module or ""
                if mod == "megazero":
                    for a in node.names:
                        yield f"megazero.{a.name}", node.lineno
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
        if mine == 0 and target.startswith("torch.distributed"):
            bad.append(f"{path}:{line}: L0 module {me} imports {target}")
        if top != "megazero" or target == "megazero":
            continue
        sub = target[len("megazero."):]
        theirs = _safe_layer(sub)
        if theirs is None and "." in sub:  # `from megazero.x import name`: x is the module
            theirs = _safe_layer(sub.rsplit(".", 1)[0])
        if theirs is None:
            bad.append(f"{path}:{line} imports unknown megazero module {target}")
        elif theirs > mine:
            bad.append(f"{path}:{line}: {me} (L{mine}) imports {target} (L{theirs}); "
                       f"a module may import only its own layer and those below")
    return bad


def _safe_layer(mod):
    try:
        return layer_of(mod)
    except KeyError:
        return None


FILES = sorted(PKG.rglob("*.py"))


def test_every_module_has_a_layer():
    unknown = [module_name(f) for f in FILES if _safe_layer(module_name(f)) is None]
    assert not unknown, f"assign these modules a layer in tests/test_layering.py: {unknown}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_respect_layers(path):
    assert violations(path) == []


def test_rule_catches_violations(tmp_path):
    pkg = tmp_path / "megazero"
    (pkg / "pipeline").mkdir(parents=True)
    (pkg / "topology.py").write_text("import torch.distributed as dist\nfrom megazero.engine import x\n")
    (pkg / "pipeline" / "schedules.py").write_text("from ..comm import send\nimport tools.planner\n")
    (pkg / "pipeline" / "executor.py").write_text("from . import schedules\nfrom megazero import comm\n")
    assert len(violations(pkg / "topology.py", pkg)) == 2
    found = violations(pkg / "pipeline" / "schedules.py", pkg)
    assert len(found) == 2 and "megazero.comm (L1)" in found[0] and "tools/" in found[1]
    assert violations(pkg / "pipeline" / "executor.py", pkg) == []
