"""Tokenizers: a byte-level tokenizer (the default) and a BPE tokenizer trained locally.

Both share one interface: ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size``,
``eod_id`` (the end-of-document token appended after each document) and ``name`` (stored in the
token file's index). Both can be saved to a JSON file and loaded back by path with
`load_tokenizer`; the preprocessing tool saves the tokenizer next to the data as
``<prefix>.tokenizer.json``.

The BPE tokenizer needs the ``tokenizers`` package (Hugging Face tokenizers, the ``bench`` extra);
it is trained on the corpus itself, nothing is downloaded.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Protocol

from megazero.core.config.schema import TOKENIZER_CHOICES

BYTE_VOCAB_SIZE = 257  # 256 byte values + the end-of-document token
BYTE_EOD_ID = 256
EOD_TOKEN = "<|endoftext|>"
TOKENIZER_KINDS = TOKENIZER_CHOICES  # one list: the config schema's


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def save(self, path: str) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0-255 are byte values, id 256 is the end-of-document token.

    vocab_size is 257. Round-trips any text exactly; decode drops special ids and replaces
    invalid UTF-8 (e.g. a sequence cut in the middle of a character) with U+FFFD.
    """

    name = "byte"
    vocab_size = BYTE_VOCAB_SIZE
    eod_id = BYTE_EOD_ID

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bytes(self, text: str) -> bytes:
        """The token ids of `text` as a bytes object (each byte is one id); fast path for writers."""
        return text.encode("utf-8")

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def save(self, path: str) -> None:
        _write_json(path, {"megazero_tokenizer": "byte", "vocab_size": self.vocab_size,
                           "eod_id": self.eod_id})

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, eod_id={self.eod_id})"


class BPETokenizer:
    """A byte-level BPE tokenizer (GPT-2 style pre-tokenization) from the ``tokenizers`` package.

    Build one with `BPETokenizer.train(texts, vocab_size)` or load a saved one with
    `load_tokenizer(path)`. Every byte is in the base alphabet, so any text round-trips.
    """

    name = "bpe"

    def __init__(self, hf_tokenizer) -> None:
        eod = hf_tokenizer.token_to_id(EOD_TOKEN)
        if eod is None:
            raise ValueError(f"BPE tokenizer has no end-of-document token {EOD_TOKEN!r}; "
                             "train it with BPETokenizer.train")
        self._tok = hf_tokenizer
        self.eod_id = int(eod)
        self.vocab_size = int(hf_tokenizer.get_vocab_size(with_added_tokens=True))

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> "BPETokenizer":
        """Train byte-level BPE on `texts` (any iterable of documents) up to `vocab_size` ids.

        The vocabulary holds the end-of-document token, the 256 byte symbols and the merges;
        `vocab_size` must be at least 257. Training is local and deterministic for a given corpus.
        """
        tk = _import_tokenizers()
        base = 1 + len(tk.pre_tokenizers.ByteLevel.alphabet())
        if vocab_size < base:
            raise ValueError(f"--vocab-size {vocab_size} is too small for BPE: need at least {base} "
                             "(256 byte symbols + the end-of-document token)")
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOD_TOKEN],
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` for many documents at once (uses the package's thread pool)."""
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, path: str) -> None:
        _ensure_parent(path)
        self._tok.save(path)

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, eod_id={self.eod_id})"


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """A tokenizer by kind (``"byte"``) or from a JSON file saved by a tokenizer's ``save``.

    A BPE tokenizer can only be loaded from its file (it was trained on a corpus).
    """
    if name_or_path == "byte":
        return ByteTokenizer()
    if name_or_path == "bpe":
        raise ValueError("tokenizer 'bpe' must be loaded from its file (<prefix>.tokenizer.json, "
                         "written by tools/preprocess_data.py --tokenizer bpe)")
    if not os.path.isfile(name_or_path):
        raise FileNotFoundError(f"tokenizer {name_or_path!r} is neither a kind ({', '.join(TOKENIZER_KINDS)}) "
                                "nor an existing tokenizer file")
    with open(name_or_path, encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("megazero_tokenizer") == "byte":
        return ByteTokenizer()
    tk = _import_tokenizers()
    return BPETokenizer(tk.Tokenizer.from_file(name_or_path))


def tokenizer_path(prefix: str) -> str:
    """Where the tokenizer of the token file ``<prefix>.bin`` is saved."""
    return prefix + ".tokenizer.json"


def check_vocab(data_vocab: int, model_vocab: int, tokenizer_name: str = "") -> None:
    """Raise ValueError if token ids of a `data_vocab`-sized tokenizer do not fit the model's embedding.

    A model vocab larger than the data's is fine (e.g. padded to a multiple of the tp size).
    """
    if data_vocab > model_vocab:
        which = f" (tokenizer {tokenizer_name!r})" if tokenizer_name else ""
        raise ValueError(f"model.vocab={model_vocab} is smaller than the data's vocab {data_vocab}{which}: "
                         f"set model.vocab to at least {data_vocab}, or preprocess the data with a "
                         "smaller tokenizer")


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as e:
        raise ImportError("the BPE tokenizer needs the 'tokenizers' package: "
                          "pip install 'megazero[bench]' (or pip install tokenizers)") from e
    return tokenizers


def _ensure_parent(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)


def _write_json(path: str, obj: dict) -> None:
    _ensure_parent(path)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
