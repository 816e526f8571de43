"""The documents point at real code: every `path.py:name` that README.md and docs/*.md cite names a
file of the repository that defines `name` (a function or class, or `Class.method`), every
document a docstring or document cites is in the repository, and every command (`make` target, tool
and its flags, `python -m` module), config file and config key a document names exists. The README
stays an entry page, and no document tells the project's history."""
import ast
import functools
import importlib.util
import os
import pathlib
import re
import runpy
import sys

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


# ---------------------------------------------------------------------------------------------------------
# Commands and config keys: every `make` target, tool flag, `python -m` module, config file and config key a
# document names is real.

README_MAX_LINES = 250  # the README is an entry page; topics live in docs/


def code_of(doc: pathlib.Path) -> list[str]:
    """The code a document shows: each inline code span, and each line of its code blocks (a line ending in
    a backslash joined with the next; a shell prompt `$ ` dropped; comment lines and trailing `  # ...`
    comments dropped). Rows of the DeepSpeed name-by-name table are left out: they name DeepSpeed's API
    (`comm.get_rank`), not megazero's config keys, and tests/test_compat_table.py checks them."""
    text, out = doc.read_text(), []
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith("#"):
                continue
            out.append(re.sub(r"\s+#\s.*$", "", line.removeprefix("$ ")))
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
    in_api_table = False
    for line in prose.splitlines():
        in_api_table = line.startswith("| DeepSpeed name") or (in_api_table and line.startswith("|"))
        if not in_api_table:
            out += re.findall(r"`([^`\n]+)`", line)
    return out


def prose_of(doc: pathlib.Path) -> str:
    """A document without its code blocks and code spans."""
    text = re.sub(r"^```[^\n]*\n.*?^```", "", doc.read_text(), flags=re.M | re.S)
    return re.sub(r"`[^`\n]+`", "", text)


# config keys as documents write them: `zero.stage`, `parallel.cp=4`, `model.moe.*`, `model.layers/hidden`; a
# key is not part of a longer dotted name (`megazero.zero.Init`) or a path, and not a call (`model.parameters()`)
SECTIONS = ("parallel", "train", "model", "data", "zero", "fp16", "optimizer", "scheduler", "activation_checkpointing",
            "pipeline", "checkpoint", "log", "trace", "comm", "resilience")
KEY = re.compile(rf"(?<![\w./-])((?:{'|'.join(SECTIONS)})\.[a-z_*][\w.*/]*)(?![\w.(*/])")


def config_keys(doc: pathlib.Path) -> list[str]:
    keys = []
    for code in code_of(doc):
        for key in KEY.findall(code):
            if re.search(r"\.(?:py|txt|safetensors|json|ya?ml|md|csv|bin|idx|svg|html|png|pdf)$", key):
                continue  # a file name (`comm.py`, `model.safetensors`), not a key
            head, *more = key.split("/")  # model.layers/hidden/heads: three keys of one section
            keys += [head] + [head.rsplit(".", 1)[0] + "." + m for m in more]
    return keys


def unknown_keys(doc: pathlib.Path) -> list[str]:
    """Keys that are neither megazero's (`megazero/core/config/schema.py`) nor a DeepSpeed key megazero reads
    (`megazero/core/config/deepspeed_keys.py`, e.g. `fp16.enabled`, `optimizer.params.lr`)."""
    from megazero.core.config import deepspeed_keys
    from megazero.core.config.schema import all_keys

    ours, theirs = set(all_keys()), {r.ds for r in deepspeed_keys.RULES}
    bad = []
    for key in config_keys(doc):
        key = key.removesuffix(".*")
        open_dict = key.startswith("model.overrides.")  # the spec's own fields, checked against the spec at load
        if key not in ours and key not in theirs and not open_dict:
            bad.append(key)
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_config_key_is_a_real_key(doc):
    assert unknown_keys(doc) == []


def test_the_documents_name_config_keys_and_a_wrong_one_is_caught(tmp_path):
    assert len(config_keys(ROOT / "docs" / "config.md")) > 60
    doc = tmp_path / "doc.md"
    doc.write_text("`zero.stage`, `parallel.cp=4`, `model.layers/hidden`, `model.moe.*`, `fp16.enabled`, "
                   "`megazero.zero.Init`, `model.parameters()`, `zero.stagee`, `model.layers/hiddn`\n"
                   "```bash\ntorchrun -m megazero.run.train x.yaml parallel.pp=2 parallel.ppp=2\n```\n")
    assert unknown_keys(doc) == ["parallel.ppp", "zero.stagee", "model.hiddn"]


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([\w.-]+)\s*:(?!=)", text, re.M))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_make_target_exists(doc):
    named = {t for code in code_of(doc) for t in re.findall(r"(?<![\w-])make ([a-z][\w-]*)", code)}
    assert named - make_targets() == set()


CLI = re.compile(r"(?:(?<![\w/])((?:tools|benchmarks)/[\w/]+\.(?:py|sh))|python3? -m ((?:megazero|torch)[\w.]*))"
                 r"((?:\s+[^\s;|&]+)*)")


@functools.cache
def cli_help(target: str, sub: str = "") -> str:
    """The `--help` text of a tool, benchmark or module (and of its subcommand `sub`), run in a forked child
    of this process (the trainer ends its process with os._exit; torch, imported here first, is shared);
    for a shell script, its text."""
    if target.endswith(".sh"):
        return (ROOT / target).read_text()
    import megazero.engine  # noqa: F401  (torch and megazero imported once here, inherited by every child)

    argv = [sub, "--help"] if sub else ["--help"]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: print the help into the pipe and end, whatever the tool does at exit
        os.close(read)
        try:
            sys.stdout, sys.stderr = os.fdopen(write, "w"), open(os.devnull, "w")
            if target.endswith(".py"):
                sys.argv = [str(ROOT / target), *argv]
                sys.path.insert(0, str((ROOT / target).parent))
                runpy.run_path(str(ROOT / target), run_name="__main__")
            else:
                sys.argv = [target, *argv]
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        except BaseException:  # noqa: BLE001  (argparse's SystemExit after the help, or a failure: no help)
            pass
        finally:
            sys.stdout.flush()
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    return text


def cli_flags(target: str, sub: str = "") -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][\w-]*", cli_help(target, sub)))


def subcommands(target: str) -> set[str]:
    usage = cli_help(target)
    found = re.search(r"\{([\w,-]+)\}", usage)
    return set(found.group(1).split(",")) if found and not target.endswith(".sh") else set()


def commands(doc: pathlib.Path) -> list[tuple[str, str, list[str]]]:
    """(tool or module, subcommand or "", its --flags) of every command a document shows."""
    out = []
    for code in code_of(doc):
        for script, module, args in CLI.findall(code):
            target = script or module
            if target.startswith("torch"):
                continue  # torch's own modules
            words = args.split()
            sub = words[0] if words and words[0] in subcommands(target) else ""
            out.append((target, sub, [re.sub(r"=.*", "", w) for w in words if w.startswith("--")]))
    return out


def wrong_commands(doc: pathlib.Path) -> list[str]:
    bad = []
    for target, sub, flags in commands(doc):
        if target.endswith((".py", ".sh")) and not (ROOT / target).is_file():
            bad.append(f"{target}: no such file")
        elif not target.endswith((".py", ".sh")) and importlib.util.find_spec(target) is None:
            bad.append(f"python -m {target}: no such module")
        else:
            bad += [f"{target} {sub}{' ' if sub else ''}{f}: no such flag" for f in flags
                    if f not in cli_flags(target, sub)]
    return bad


def wrong_torchrun_flags(doc: pathlib.Path) -> list[str]:
    """torchrun's own flags (before `-m` or the script) that torchrun does not have."""
    bad = []
    for code in code_of(doc):
        for launcher_args in re.findall(r"(?<![\w/-])torchrun((?:\s+(?!-m\b)[^\s;|&]+)*)", code):
            bad += [f"torchrun {f}: no such flag" for f in re.findall(r"(?<![\w-])--[a-z][\w-]*", launcher_args)
                    if f not in torchrun_flags()]
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_command_and_flag_exists(doc):
    assert wrong_commands(doc) + wrong_torchrun_flags(doc) == []


def test_the_documents_show_commands_and_a_wrong_one_is_caught(tmp_path):
    assert len(commands(ROOT / "README.md")) >= 5
    doc = tmp_path / "doc.md"
    doc.write_text("`python tools/plan.py gpt:debug --gpus 8 --gpuss 8`, `python -m megazero.core.config explain x.yaml "
                   "--world-size 8`, `python tools/convert_checkpoint.py to-hf a b --dtype bf16 --tag x`, "
                   "`python -m megazero.nothing`, `python tools/nothing.py`\n")
    doc.write_text(doc.read_text() + "```bash\ntorchrun --nproc_per_node=2 --max-restarts=3 --max-restartz=1 -m x --nope\n```\n")
    assert wrong_torchrun_flags(doc) == ["torchrun --max-restartz: no such flag"]
    assert wrong_commands(doc) == ["tools/plan.py --gpuss: no such flag", "tools/convert_checkpoint.py to-hf --tag: no such flag",
                                   "python -m megazero.nothing: no such module", "tools/nothing.py: no such file"]


@functools.cache
def torchrun_flags() -> set[str]:
    from torch.distributed.run import get_args_parser

    return set(re.findall(r"(?<![\w-])--[a-z][\w-]*", get_args_parser().format_help()))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_flag_named_alone_belongs_to_a_command(doc):
    """A flag written on its own (`--search`) is a flag of a command the documents show, or torchrun's."""
    known = torchrun_flags()
    for d in DOCS:
        for target, sub, _ in commands(d):
            if not target.startswith("torch") and (target.endswith((".py", ".sh")) or importlib.util.find_spec(target)):
                known |= cli_flags(target, sub) | cli_flags(target)
    alone = {m for code in code_of(doc) for m in re.findall(r"^(--[a-z][\w-]*)", code)}
    assert alone - known == set()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_config_file_and_hardware_preset_exists(doc):
    code = "\n".join(code_of(doc))
    named = set(re.findall(r"(?<![\w/])(configs/[\w/.-]+\.ya?ml)", code))
    named |= {f"configs/hardware/{h}.yaml" for h in re.findall(r"--hardware[ =]([\w.-]+)", code) if not h.endswith(".yaml")}
    assert {p for p in named if not (ROOT / p).is_file()} == set()


def model_specs(doc: pathlib.Path) -> set[str]:
    """The model specs a document names: `model_specs/llama.py:debug-moe`, and tools/plan.py's `gpt:gpt3-175b`."""
    code = "\n".join(code_of(doc))
    named = set(re.findall(r"(?<![\w/])(model_specs/\w+\.py:[\w.-]*\w)", code))
    return named | {f"model_specs/{f}.py:{v}" for f, v in re.findall(r"(?<![\w/.-])(gpt|llama):([\w.-]*\w)", code)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_model_spec_flavor_exists(doc):
    from megazero.core.spec import SpecError, load_spec

    missing = []
    for ref in sorted(model_specs(doc)):
        try:
            load_spec(str(ROOT / ref))
        except SpecError as err:
            missing.append(f"{ref}: {err}")
    assert missing == []


def test_a_wrong_model_spec_is_named(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("`model_specs/gpt.py:nope`, `python tools/plan.py llama:debug-moe --gpus 8`\n")
    assert model_specs(doc) == {"model_specs/gpt.py:nope", "model_specs/llama.py:debug-moe"}


def test_the_readme_is_an_entry_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", "\n".join(lines)))
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set(), "every docs page is on the README's map"


# A document says what is true now; the project's history lives in git. Each pattern below marks a sentence
# about an earlier state, and none has an innocent reading in these documents (checked on prose only, code
# blocks and spans removed):
HISTORY = [
    r"\bissues? #?\d+",  # an issue number: what was asked once, not what the code does
    r"\b(?:was|were) once\b|\bonce (?:was|were)\b",
    r"\bbefore this\b",
    r"\bno longer\b",
    r"\b(?:it|this|they|that|which|megazero|stage \d) used to\b",  # habitual past ("used to hold"), not "used to compute"
    r"(?<!for )\bnow\b",  # "now" contrasts with before; "for now" speaks of the present
    r"\b(?:the|an?) (?:earlier|previous|old) (?:version|matrix|run|figures?|measurements?)\b",
    r"\bwhat the table taught\b",
]


def history_sentences(doc: pathlib.Path) -> list[str]:
    prose = prose_of(doc)
    return [m.group(0) for pattern in HISTORY for m in re.finditer(pattern, prose, re.I)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_document_tells_history(doc):
    assert history_sentences(doc) == []


def test_a_history_sentence_is_caught(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("It was once blind (issue 12); before this, stage 3 used to hold more. It now counts them, "
                   "unlike the earlier matrix. Refused for now. `now` in code is fine.\n")
    assert history_sentences(doc) == ["issue 12", "was once", "before this", "stage 3 used to", "now",
                                      "the earlier matrix"]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_link_between_documents_resolves(doc):
    """A relative link names a file of the repository, and its #anchor a heading of that file."""
    broken = []
    for target, frag in re.findall(r"\]\(((?!https?:)[^)#\s]*)(?:#([\w-]+))?\)", prose_of(doc)):
        path = (doc.parent / target) if target else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif frag and frag not in {anchor(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}:
            broken.append(f"{target}#{frag}: no such heading")
    assert broken == []
