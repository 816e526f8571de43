"""The documents point at real code: every `path.py:name` that README.md and docs/*.md cite names a
file of the repository that defines `name` (a function or class, or `Class.method`), and every
document a docstring or document cites is in the repository."""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITATION = re.compile(r"`((?:megazero|tests|tools|benchmarks)/[\w/]+\.py):([\w.]+)`")  # model_specs/x.py:flavor is a spec
FILE = re.compile(r"`((?:megazero|tests|tools|benchmarks|model_specs|configs|docs)/[\w/.-]+\.(?:py|md|yaml|json))`")


def defined_names(path: pathlib.Path) -> set[str]:
    """Top-level functions, classes and assigned names of `path`, and `Class.method` for methods."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{n.name}" for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


def citations(doc: pathlib.Path) -> list[tuple[str, str]]:
    return CITATION.findall(doc.read_text())


def missing_citations(doc: pathlib.Path) -> list[str]:
    missing = []
    for rel, name in citations(doc):
        path = ROOT / rel
        if not path.is_file():
            missing.append(f"{rel}: no such file")
        elif name not in defined_names(path):
            missing.append(f"{rel}:{name}: not defined there")
    return missing


def test_the_documents_cite_code():
    assert len(citations(ROOT / "docs" / "architecture.md")) > 40
    assert len(citations(ROOT / "README.md")) >= 10


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_cited_function_exists(doc):
    assert missing_citations(doc) == []


def test_a_wrong_citation_is_caught(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("`megazero/core/schedules.py:get_schedule`, `megazero/core/schedules.py:no_such_function`, "
                   "`megazero/pipeline/executor.py:PipelineExecutor.run`, `megazero/gone.py:f`")
    assert missing_citations(doc) == ["megazero/core/schedules.py:no_such_function: not defined there",
                                      "megazero/gone.py: no such file"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_cited_file_exists(doc):
    missing = [rel for rel in FILE.findall(doc.read_text()) if not (ROOT / rel).exists()]
    assert missing == []


def test_no_document_outside_the_repository_is_cited():
    """Docstrings and documents cite docs/ in the repository, never a file beside it."""
    outside = []
    for path in [*ROOT.glob("megazero/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("tools/*"),
                 *ROOT.glob("benchmarks/*"), *DOCS]:
        if path.is_file() and path.name != "test_docs.py":
            text = path.read_text(errors="replace")
            outside += [f"{path.relative_to(ROOT)}: {m}" for m in re.findall(r"\.\./shared/\S+|\bREFERENCE\.md|\bDESIGN\.md", text)]
    assert outside == []
