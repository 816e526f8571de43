"""The tests' own hygiene, enforced by parsing every Python file under tests/ (ast).

A comparison over `zip(a, b)` passes when one side is short or empty: it compares nothing past the
shorter side. So every `zip(...)` call in tests/ passes `strict=True` (a length mismatch raises
ValueError), unless unequal lengths are the point; then the call, or the comment line just above
it, carries `# zip-unequal: <reason>`. Neighbouring pairs are `zip(xs[:-1], xs[1:], strict=True)`.
"""
from __future__ import annotations

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
MARKER = "# zip-unequal:"


def loose_zips(source: str) -> list[int]:
    """The line numbers of the `zip(...)` calls in `source` that neither pass `strict=True` nor carry
    the marker (with a reason after it) on one of their lines or on the line above."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "zip"):
            continue
        strict = [k.value for k in node.keywords if k.arg == "strict"]
        if strict and isinstance(strict[0], ast.Constant) and strict[0].value is True:
            continue
        near = lines[max(node.lineno - 2, 0):node.end_lineno]
        if any(MARKER in line and line.split(MARKER, 1)[1].strip() for line in near):
            continue
        found.append(node.lineno)
    return found


def test_the_check_finds_a_loose_zip_and_accepts_strict_and_marked_ones():
    assert loose_zips("for a, b in zip(x, y):\n    pass\n") == [1]
    assert loose_zips("ok = all(a == b for a, b in zip(x,\n    y))\n") == [1]
    assert loose_zips("z = zip(x, y, strict=False)\n") == [1]
    assert loose_zips("z = zip(x, y, strict=True)\n") == []
    assert loose_zips("z = zip(x, y)  # zip-unequal: x is the longer on purpose\n") == []
    assert loose_zips("# zip-unequal: x is the longer on purpose\nz = zip(x, y)\n") == []
    assert loose_zips("z = zip(x, y)  # zip-unequal:\n") == [1], "a marker without a reason does not count"


def test_every_zip_in_the_tests_checks_lengths():
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 100, f"only {len(files)} files under {TESTS}"
    bad = {str(f.relative_to(TESTS.parent)): lines for f in files if (lines := loose_zips(f.read_text()))}
    assert not bad, (f"zip(...) without strict=True (file: lines): {bad}; pass strict=True, or say why the "
                     f"lengths may differ with '{MARKER} <reason>' on the call or the line above")
