"""tools/preprocess_data.py end to end (subprocess), document sources, and its error lines."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from megazero.data.corpus import (cap_bytes, demo_corpus, file_documents, input_files, preprocess, stdlib_dir,
                                  stdlib_files)
from megazero.data.indexed import IndexedTokens
from megazero.data.sampler import build_data_iterator
from megazero.data.tokenizer import ByteTokenizer, load_tokenizer, tokenizer_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")


def run_tool(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def tool_main(argv, capsys):
    """The CLI in this process (faster than a subprocess): (exit code, stdout, stderr)."""
    spec = importlib.util.spec_from_file_location("preprocess_data", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    code = module.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_stdlib_corpus_end_to_end(tmp_path):
    prefix = str(tmp_path / "out" / "stdlib")
    proc = run_tool("--python-stdlib", "--max-bytes", "200K", "--output-prefix", prefix)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"wrote {prefix}.bin/.idx: ")
    assert "documents" in lines[0] and "tokens" in lines[0] and "MB" in lines[0]
    data = IndexedTokens(prefix)
    texts = list(demo_corpus(200_000))
    assert data.num_docs == len(texts) and data.eod_appended and data.tokenizer_name == "byte"
    assert data.num_tokens == sum(len(t.encode("utf-8")) + 1 for t in texts)
    tok = load_tokenizer(tokenizer_path(prefix))
    assert tok.decode(data.document(1).tolist()) == texts[1]
    assert int(data.document(0)[-1]) == tok.eod_id
    it = build_data_iterator(prefix, seq_len=64, micro_batch_size=2, gradient_accumulation_steps=2,
                             dp_rank=0, dp_size=2, seed=0, model_vocab=tok.vocab_size)
    assert next(it)["input_ids"].shape == (2, 64)


def test_stdlib_corpus_is_deterministic_and_capped():
    files = stdlib_files()
    assert files == sorted(files, key=lambda p: os.path.relpath(p, stdlib_dir()))  # fixed order
    assert not any("site-packages" in p.split(os.sep) for p in files)
    docs = list(demo_corpus(100_000))
    assert docs == list(demo_corpus(100_000))
    total = sum(len(d.encode("utf-8")) for d in docs)
    assert total >= 100_000 and total - len(docs[-1].encode("utf-8")) < 100_000


def test_directories_files_and_jsonl(tmp_path):
    (tmp_path / "a" / "deep").mkdir(parents=True)
    (tmp_path / "a" / "z.txt").write_text("zed")
    (tmp_path / "a" / "deep" / "y.txt").write_text("why")
    (tmp_path / "a" / "skip.md").write_text("not matched")
    (tmp_path / "one.md").write_text("single file")
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text(json.dumps({"text": "first", "id": 1}) + "\n\n" + json.dumps({"text": "", "id": 2}) + "\n"
                     + json.dumps({"text": "second ☕"}) + "\n")
    files = input_files([str(tmp_path / "a"), str(tmp_path / "one.md"), str(jsonl)])
    assert [os.path.relpath(f, tmp_path) for f in files] == ["a/deep/y.txt", "a/z.txt", "one.md", "c.jsonl"]
    docs = list(file_documents(files))
    assert docs == ["why", "zed", "single file", "first", "", "second ☕"]
    assert list(cap_bytes(docs, 4)) == ["why", "zed"]
    s = preprocess(docs, str(tmp_path / "o"), append_eod=False)
    assert (s.documents, s.tokens) == (5, len("whyzedsingle filefirstsecond ☕".encode("utf-8")))
    data = IndexedTokens(str(tmp_path / "o"))
    assert ByteTokenizer().decode(data.document(4).tolist()) == "second ☕" and not data.eod_appended


def test_cli_bpe(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(30):
        (src / f"f{i:02d}.py").write_text(f"def function_{i}(value):\n    return value * {i} + {i}\n" * 5)
    prefix = str(tmp_path / "bpe")
    code, out, err = tool_main(["--input", str(src), "--glob", "*.py", "--output-prefix", prefix,
                                "--tokenizer", "bpe", "--vocab-size", "300"], capsys)
    assert code == 0, err
    assert "tokenizer bpe (vocab 300)" in out
    data, tok = IndexedTokens(prefix), load_tokenizer(tokenizer_path(prefix))
    assert data.vocab_size == tok.vocab_size == 300 and data.tokenizer_name == "bpe"
    assert tok.decode(data.document(3).tolist()) == (src / "f03.py").read_text()


@pytest.mark.parametrize("args,message", [
    (["--input", "/no/such/dir"], "--input /no/such/dir: no such file or directory"),
    (["--input", "{tmp}"], "no files matching --glob '*.txt' in this directory"),
    (["--python-stdlib", "--tokenizer", "bpe"], "--tokenizer bpe needs --vocab-size N"),
    (["--python-stdlib", "--vocab-size", "300"], "--vocab-size applies to --tokenizer bpe only"),
    (["--input", "{tmp}/bad.jsonl"], "bad.jsonl:1: no key 'text' (--json-key); keys here: ['body']"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, args, message):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code, out, err = tool_main(args + ["--output-prefix", str(tmp_path / "out")], capsys)
    assert code == 1 and out == ""
    err = err.strip()
    assert "\n" not in err and err.startswith("preprocess_data.py: error: ") and message in err, err
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]  # nothing half-written
