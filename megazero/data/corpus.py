"""Text sources and preprocessing: documents from files, directories, JSONL or the Python stdlib.

`preprocess` tokenizes documents into ``<prefix>.bin/.idx`` and saves the tokenizer as
``<prefix>.tokenizer.json``; tools/preprocess_data.py is its command line. The demo corpus is the
Python standard library's own source (`stdlib_files`): real text on every machine, no download.
"""
from __future__ import annotations

import array
import fnmatch
import json
import os
import sysconfig
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

from .indexed import IndexedWriter, itemsize_for_vocab
from .tokenizer import BPETokenizer, ByteTokenizer, tokenizer_path

JSONL_SUFFIXES = (".jsonl", ".ndjson")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
Documents = Union[Iterable[str], Callable[[], Iterable[str]]]


@dataclass(frozen=True)
class PreprocessSummary:
    """What `preprocess` wrote."""

    prefix: str
    documents: int
    tokens: int
    text_bytes: int
    bin_bytes: int
    tokenizer: str
    vocab_size: int
    seconds: float

    def line(self) -> str:
        """One line for the terminal."""
        dtype = "uint16" if itemsize_for_vocab(self.vocab_size) == 2 else "uint32"
        return (f"wrote {self.prefix}.bin/.idx: {self.documents} documents, {self.tokens} tokens "
                f"({self.bin_bytes / 1e6:.2f} MB {dtype}) from {self.text_bytes / 1e6:.2f} MB of text, "
                f"tokenizer {self.tokenizer} (vocab {self.vocab_size}), {self.seconds:.2f} s")


def stdlib_dir() -> str:
    """The directory of this Python's standard library sources."""
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: Optional[str] = None) -> list[str]:
    """Every ``*.py`` under the stdlib (or `root`), site-packages excluded, sorted by relative path."""
    root = root or stdlib_dir()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        found += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    if not found:
        raise FileNotFoundError(f"no *.py files under {root}: this Python ships no stdlib sources; "
                                "pass --input with your own text files instead")
    return sorted(found, key=lambda p: os.path.relpath(p, root).replace(os.sep, "/"))


def demo_corpus(max_bytes: Optional[int] = None) -> Iterator[str]:
    """The Python standard library's source files as documents, in a fixed order, capped at `max_bytes`."""
    return cap_bytes((_read_text(p) for p in stdlib_files()), max_bytes)


def input_files(inputs: Sequence[str], glob: str = "*.txt") -> list[str]:
    """Files named by `inputs`: files as given, directories searched recursively for `glob` (sorted)."""
    files = []
    for path in inputs:
        if os.path.isfile(path):
            files.append(path)
        elif os.path.isdir(path):
            matched = []
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = [d for d in dirnames if d != "__pycache__"]
                matched += [os.path.join(dirpath, f) for f in filenames if fnmatch.fnmatch(f, glob)]
            if not matched:
                raise FileNotFoundError(f"--input {path}: no files matching --glob {glob!r} in this directory "
                                        "(pass --glob, e.g. --glob '*.md')")
            files += sorted(matched, key=lambda p: os.path.relpath(p, path).replace(os.sep, "/"))
        else:
            raise FileNotFoundError(f"--input {path}: no such file or directory")
    return files


def file_documents(files: Sequence[str], json_key: str = "text") -> Iterator[str]:
    """One document per text file; one per line of a ``.jsonl`` file (the string at `json_key`)."""
    for path in files:
        if path.endswith(JSONL_SUFFIXES):
            yield from _jsonl_documents(path, json_key)
        else:
            yield _read_text(path)


def cap_bytes(documents: Iterable[str], max_bytes: Optional[int]) -> Iterator[str]:
    """`documents` up to and including the one whose UTF-8 size brings the total to `max_bytes`."""
    total = 0
    for doc in documents:
        if max_bytes is not None and total >= max_bytes:
            return
        total += len(doc.encode("utf-8"))
        yield doc


def preprocess(documents: Documents, output_prefix: str, tokenizer: str = "byte",
               vocab_size: Optional[int] = None, append_eod: bool = True) -> PreprocessSummary:
    """Tokenize `documents` into ``<output_prefix>.bin/.idx`` and save ``<output_prefix>.tokenizer.json``.

    `documents` is an iterable of strings, or a function returning one (BPE reads the corpus twice:
    once to train, once to encode; a plain iterable is then held in memory). Empty documents are
    skipped. With `append_eod` every document ends with the tokenizer's end-of-document token.
    """
    start = time.perf_counter()
    if tokenizer == "byte":
        if vocab_size is not None:
            raise ValueError("--vocab-size applies to --tokenizer bpe only (the byte tokenizer has 257)")
        tok = ByteTokenizer()
    elif tokenizer == "bpe":
        if vocab_size is None:
            raise ValueError("--tokenizer bpe needs --vocab-size N (e.g. 4096)")
        if not callable(documents):
            documents = list(documents)
        tok = BPETokenizer.train(_nonempty(_fresh(documents)), vocab_size)
    else:
        raise ValueError(f"--tokenizer {tokenizer!r} is not one of: byte, bpe")
    text_bytes = 0
    with IndexedWriter(output_prefix, tok.vocab_size, tok.name, eod_appended=append_eod) as writer:
        for arrays, nbytes in _encode_stream(tok, _nonempty(_fresh(documents)), append_eod, writer.itemsize):
            text_bytes += nbytes
            for arr in arrays:
                writer.add_document(arr)
        if writer.num_docs == 0:
            raise ValueError(f"no non-empty documents to write to {output_prefix}: check --input")
        written = writer.finalize()
    tok.save(tokenizer_path(output_prefix))
    return PreprocessSummary(output_prefix, written.num_docs, written.num_tokens, text_bytes,
                             written.bin_bytes, tok.name, tok.vocab_size, time.perf_counter() - start)


def _encode_stream(tok, documents: Iterator[str], append_eod: bool, itemsize: int, chunk: int = 256):
    """Yield (list of token arrays, utf-8 bytes of their text) for chunks of `documents`."""
    code = "H" if itemsize == 2 else "I"
    batch: list[str] = []
    for doc in documents:
        batch.append(doc)
        if len(batch) == chunk:
            yield _encode_batch(tok, batch, append_eod, code)
            batch = []
    if batch:
        yield _encode_batch(tok, batch, append_eod, code)


def _encode_batch(tok, texts: list[str], append_eod: bool, code: str):
    if isinstance(tok, ByteTokenizer):
        encoded = [array.array(code, list(tok.encode_bytes(t))) for t in texts]
    else:
        encoded = [array.array(code, ids) for ids in tok.encode_batch(texts)]
    if append_eod:
        for arr in encoded:
            arr.append(tok.eod_id)
    return encoded, sum(len(t.encode("utf-8")) for t in texts)


def _fresh(documents: Documents) -> Iterable[str]:
    return documents() if callable(documents) else documents


def _nonempty(documents: Iterable[str]) -> Iterator[str]:
    return (d for d in documents if d)


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        return f.read()


def _jsonl_documents(path: str, key: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({e.msg})") from e
            if not isinstance(obj, dict) or key not in obj:
                keys = sorted(obj) if isinstance(obj, dict) else []
                raise ValueError(f"{path}:{lineno}: no key {key!r} (--json-key); keys here: {keys}")
            if not isinstance(obj[key], str):
                raise ValueError(f"{path}:{lineno}: {key!r} holds {type(obj[key]).__name__}, not a string")
            yield obj[key]
