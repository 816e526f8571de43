"""A memory-mapped token file plus index: ``<prefix>.bin`` and ``<prefix>.idx``.

``.bin`` holds every document's token ids back to back, little-endian, uint16 when the vocab fits
(vocab_size <= 65536) else uint32. ``.idx`` is a small header followed by the document offsets:

    magic     8 bytes  b"MZTOKIDX"
    version   uint32   1
    itemsize  uint32   2 (uint16) or 4 (uint32): bytes per token in .bin
    vocab     uint32   tokenizer vocab size (every id is < vocab)
    flags     uint32   bit 0: an end-of-document token ends every document
    num_docs  uint64
    tokens    uint64   total tokens in .bin
    name_len  uint32   then the tokenizer name (utf-8), zero-padded to a multiple of 8 bytes
    offsets   int64[num_docs + 1]: document d is tokens [offsets[d], offsets[d + 1])

The reader maps ``.bin`` with `mmap` and views it as a torch tensor (no numpy); reading a slice
touches only that slice's pages. No process groups here: readers are per rank.
"""
from __future__ import annotations

import array
import mmap
import os
import struct
import sys
from dataclasses import dataclass
from typing import Sequence, Union

import torch

MAGIC = b"MZTOKIDX"
VERSION = 1
FLAG_EOD = 1
_HEADER = struct.Struct("<8sIIIIQQI")
_TORCH_DTYPE = {2: torch.uint16, 4: torch.uint32}
_ARRAY_CODE = {2: "H", 4: "I"}

Tokens = Union[Sequence[int], bytes, bytearray, array.array]


class DataPathError(FileNotFoundError):
    """A token file that does not exist; the message says how to create it."""


def preprocess_hint(prefix: str) -> str:
    """The command that creates ``<prefix>.bin/.idx`` (used in error messages)."""
    return (f"python tools/preprocess_data.py --input TEXT_FILES_OR_DIRS --output-prefix {prefix} "
            f"(or --python-stdlib for the demo corpus)")


def itemsize_for_vocab(vocab_size: int) -> int:
    """Bytes per token in ``.bin``: 2 (uint16) if every id < `vocab_size` fits, else 4 (uint32)."""
    if vocab_size < 1 or vocab_size > 2**32:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, 2**32]")
    return 2 if vocab_size <= 2**16 else 4


@dataclass(frozen=True)
class IndexSummary:
    """What a writer wrote."""

    prefix: str
    num_docs: int
    num_tokens: int
    bin_bytes: int
    vocab_size: int
    tokenizer_name: str


class IndexedWriter:
    """Writes ``<prefix>.bin`` and ``<prefix>.idx``; use as a context manager or call `finalize`.

    Files are written under temporary names and renamed on `finalize`, so a crash never leaves a
    token file that looks complete.
    """

    def __init__(self, prefix: str, vocab_size: int, tokenizer_name: str, eod_appended: bool = False):
        self.prefix = prefix
        self.vocab_size = int(vocab_size)
        self.tokenizer_name = tokenizer_name
        self.eod_appended = eod_appended
        self.itemsize = itemsize_for_vocab(self.vocab_size)
        self._offsets = array.array("q", [0])
        parent = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(parent, exist_ok=True)
        self._bin_tmp = prefix + ".bin.tmp"
        self._bin = open(self._bin_tmp, "wb")
        self._done = False

    def add_document(self, ids: Tokens) -> None:
        """Append one document's token ids: a list of ints, an array.array, or bytes (one id per byte)."""
        code = _ARRAY_CODE[self.itemsize]
        if isinstance(ids, array.array) and ids.typecode == code:
            arr = ids
        elif isinstance(ids, (bytes, bytearray)):
            arr = array.array(code, list(ids))  # a bytes initializer would be read as raw machine values
        else:
            arr = array.array(code)
            try:
                arr.fromlist([int(i) for i in ids])
            except OverflowError as e:
                raise ValueError(f"a token id is outside [0, vocab_size={self.vocab_size})") from e
        if len(arr) and max(arr) >= self.vocab_size:
            raise ValueError(f"token id {max(arr)} is outside [0, vocab_size={self.vocab_size})")
        if sys.byteorder != "little":
            arr = array.array(code, arr)
            arr.byteswap()
        self._bin.write(arr.tobytes())
        self._offsets.append(self._offsets[-1] + len(arr))

    @property
    def num_docs(self) -> int:
        """Documents added so far."""
        return len(self._offsets) - 1

    def finalize(self) -> IndexSummary:
        """Close and publish both files; returns what was written."""
        if self._done:
            raise RuntimeError(f"IndexedWriter({self.prefix!r}) was already finalized")
        self._done = True
        self._bin.close()
        num_docs, num_tokens = len(self._offsets) - 1, self._offsets[-1]
        name = self.tokenizer_name.encode("utf-8")
        pad = (-(_HEADER.size + len(name))) % 8
        header = _HEADER.pack(MAGIC, VERSION, self.itemsize, self.vocab_size,
                              FLAG_EOD if self.eod_appended else 0, num_docs, num_tokens, len(name))
        offsets = array.array("q", self._offsets)
        if sys.byteorder != "little":
            offsets.byteswap()
        idx_tmp = self.prefix + ".idx.tmp"
        with open(idx_tmp, "wb") as f:
            f.write(header + name + b"\0" * pad + offsets.tobytes())
        os.replace(self._bin_tmp, self.prefix + ".bin")
        os.replace(idx_tmp, self.prefix + ".idx")
        return IndexSummary(self.prefix, num_docs, num_tokens, num_tokens * self.itemsize,
                            self.vocab_size, self.tokenizer_name)

    def abort(self) -> None:
        """Drop everything written so far."""
        self._done = True
        self._bin.close()
        if os.path.exists(self._bin_tmp):
            os.remove(self._bin_tmp)

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.finalize()


class IndexedTokens:
    """Read-only view of ``<prefix>.bin/.idx``: the concatenated token stream and its documents.

    Attributes: prefix, vocab_size, tokenizer_name, eod_appended, num_docs, num_tokens,
    doc_offsets (LongTensor of num_docs + 1 token offsets).
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        missing = [p for p in (prefix + ".idx", prefix + ".bin") if not os.path.isfile(p)]
        if missing:
            raise DataPathError(f"data not found: {' and '.join(missing)} "
                                f"{'does' if len(missing) == 1 else 'do'} not exist; "
                                f"create it with: {preprocess_hint(prefix)}")
        self._read_index(prefix + ".idx")
        expected = self.num_tokens * self.itemsize
        actual = os.path.getsize(prefix + ".bin")
        if actual != expected:
            raise ValueError(f"{prefix}.bin has {actual} bytes but {prefix}.idx says {self.num_tokens} "
                             f"tokens x {self.itemsize} bytes = {expected}; the file is truncated or "
                             f"from another run: recreate it with {preprocess_hint(prefix)}")
        if sys.byteorder != "little":
            raise RuntimeError("IndexedTokens reads little-endian token files on little-endian hosts only")
        self._open_bin()

    def _read_index(self, path: str) -> None:
        with open(path, "rb") as f:
            raw = f.read()
        if len(raw) < _HEADER.size or raw[:8] != MAGIC:
            raise ValueError(f"{path} is not a megazero token index (bad magic); "
                             f"recreate it with {preprocess_hint(self.prefix)}")
        (_, version, itemsize, vocab, flags, num_docs, num_tokens, name_len) = _HEADER.unpack_from(raw)
        if version != VERSION or itemsize not in _TORCH_DTYPE:
            raise ValueError(f"{path}: index version {version} / itemsize {itemsize} is not supported "
                             f"(this megazero reads version {VERSION}, itemsize 2 or 4)")
        start = _HEADER.size + name_len + (-(_HEADER.size + name_len)) % 8
        self.tokenizer_name = raw[_HEADER.size:_HEADER.size + name_len].decode("utf-8")
        self.itemsize, self.vocab_size = itemsize, vocab
        self.eod_appended = bool(flags & FLAG_EOD)
        self.num_docs, self.num_tokens = num_docs, num_tokens
        if len(raw) != start + 8 * (num_docs + 1):
            raise ValueError(f"{path} is truncated: expected {num_docs + 1} document offsets")
        self.doc_offsets = torch.frombuffer(bytearray(raw[start:]), dtype=torch.int64)

    def _open_bin(self) -> None:
        self._file = open(self.prefix + ".bin", "rb")
        if self.num_tokens == 0:
            self._mmap = None
            self._tokens = torch.zeros(0, dtype=_TORCH_DTYPE[self.itemsize])
            return
        # ACCESS_COPY (a private mapping) gives a writable buffer, so torch.frombuffer does not warn;
        # nothing is ever written through it.
        self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
        self._tokens = torch.frombuffer(self._mmap, dtype=_TORCH_DTYPE[self.itemsize])

    @property
    def dtype(self) -> torch.dtype:
        """The on-disk token dtype (torch.uint16 or torch.uint32)."""
        return _TORCH_DTYPE[self.itemsize]

    def tokens(self, start: int, length: int) -> torch.Tensor:
        """Tokens [start, start + length) of the concatenated stream as a LongTensor (length,)."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside [0, {self.num_tokens}) "
                             f"of {self.prefix}")
        return self._tokens[start:start + length].to(torch.int64)

    def document(self, d: int) -> torch.Tensor:
        """Document `d`'s tokens as a LongTensor."""
        if not 0 <= d < self.num_docs:
            raise IndexError(f"document {d} outside [0, {self.num_docs}) of {self.prefix}")
        lo, hi = int(self.doc_offsets[d]), int(self.doc_offsets[d + 1])
        return self.tokens(lo, hi - lo)

    def __len__(self) -> int:
        return self.num_docs

    def close(self) -> None:
        """Release the mapping; the object is unusable afterwards."""
        self._tokens = None
        if self._mmap is not None:
            self._mmap.close()
        self._file.close()

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}  # pickled readers (e.g. DataLoader workers) reopen the files

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    def __repr__(self) -> str:
        return (f"IndexedTokens({self.prefix!r}, docs={self.num_docs}, tokens={self.num_tokens}, "
                f"vocab={self.vocab_size}, tokenizer={self.tokenizer_name!r})")


class InMemoryTokens:
    """The `IndexedTokens` interface over documents held in memory (for tests and tiny examples)."""

    def __init__(self, docs: Sequence[Sequence[int]], vocab_size: int, tokenizer_name: str = "memory",
                 eod_appended: bool = False):
        lengths = [len(d) for d in docs]
        flat = [int(t) for d in docs for t in d]
        if flat and (min(flat) < 0 or max(flat) >= vocab_size):
            raise ValueError(f"token ids must be in [0, vocab_size={vocab_size})")
        self.prefix = "<memory>"
        self.vocab_size, self.tokenizer_name, self.eod_appended = vocab_size, tokenizer_name, eod_appended
        self.num_docs, self.num_tokens = len(docs), len(flat)
        self.doc_offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        self._tokens = torch.tensor(flat, dtype=torch.int64)

    def tokens(self, start: int, length: int) -> torch.Tensor:
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside [0, {self.num_tokens})")
        return self._tokens[start:start + length].clone()

    def document(self, d: int) -> torch.Tensor:
        return self.tokens(int(self.doc_offsets[d]), int(self.doc_offsets[d + 1] - self.doc_offsets[d]))

    def __len__(self) -> int:
        return self.num_docs
