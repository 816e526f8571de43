"""The memory-mapped token file: writer/reader round-trip, dtypes, header, and clear errors."""
import os
import pickle

import pytest
import torch

from megazero.data.indexed import (DataPathError, IndexedTokens, IndexedWriter, InMemoryTokens,
                                   itemsize_for_vocab)

DOCS = [[1, 2, 3], [], [256, 0], list(range(40))]


def write(prefix, docs, vocab, name="byte", eod=True):
    with IndexedWriter(str(prefix), vocab, name, eod_appended=eod) as w:
        for d in docs:
            w.add_document(d)
    return str(prefix)


def test_itemsize_for_vocab():
    assert itemsize_for_vocab(257) == 2 and itemsize_for_vocab(65536) == 2
    assert itemsize_for_vocab(65537) == 4 and itemsize_for_vocab(200_000) == 4
    with pytest.raises(ValueError, match="vocab_size=0"):
        itemsize_for_vocab(0)


@pytest.mark.parametrize("vocab,itemsize,dtype", [(257, 2, torch.uint16), (100_000, 4, torch.uint32)])
def test_round_trip(tmp_path, vocab, itemsize, dtype):
    docs = DOCS + ([[vocab - 1, 70_000]] if vocab > 70_000 else [[vocab - 1]])
    prefix = write(tmp_path / "d", docs, vocab, name="bpe")
    r = IndexedTokens(prefix)
    flat = [t for d in docs for t in d]
    assert (r.num_docs, r.num_tokens, r.vocab_size, r.tokenizer_name) == (len(docs), len(flat), vocab, "bpe")
    assert r.itemsize == itemsize and r.dtype == dtype and r.eod_appended and len(r) == len(docs)
    assert os.path.getsize(prefix + ".bin") == len(flat) * itemsize
    assert r.doc_offsets.tolist() == [0, 3, 3, 5, 45, 45 + len(docs[-1])]
    for i, d in enumerate(docs):
        got = r.document(i)
        assert got.dtype == torch.int64 and got.tolist() == d
    assert r.tokens(2, 5).tolist() == flat[2:7]
    assert r.tokens(0, len(flat)).tolist() == flat
    with pytest.raises(IndexError, match=r"tokens \[44, 54\)"):
        r.tokens(44, 10)
    r.close()


def test_bytes_and_writer_summary(tmp_path):
    w = IndexedWriter(str(tmp_path / "b"), 257, "byte")
    w.add_document(b"hi\xff")
    w.add_document([256])
    s = w.finalize()
    assert (s.num_docs, s.num_tokens, s.bin_bytes) == (2, 4, 8)
    assert IndexedTokens(str(tmp_path / "b")).tokens(0, 4).tolist() == [104, 105, 255, 256]
    assert not IndexedTokens(str(tmp_path / "b")).eod_appended


def test_writer_rejects_out_of_vocab(tmp_path):
    with pytest.raises(ValueError, match=r"token id 257 is outside \[0, vocab_size=257\)"):
        write(tmp_path / "x", [[1, 257]], 257)
    with pytest.raises(ValueError, match=r"outside \[0, vocab_size=257\)"):
        write(tmp_path / "y", [[-1]], 257)
    # an exception inside the context leaves no files behind
    assert not [p for p in os.listdir(tmp_path) if p.startswith(("x.", "y."))]


def test_missing_path_is_one_clear_line(tmp_path):
    prefix = str(tmp_path / "nothing")
    with pytest.raises(DataPathError) as e:
        IndexedTokens(prefix)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"{prefix}.idx and {prefix}.bin do not exist" in msg
    assert f"tools/preprocess_data.py --input TEXT_FILES_OR_DIRS --output-prefix {prefix}" in msg


def test_truncated_and_foreign_files(tmp_path):
    prefix = write(tmp_path / "t", DOCS, 257)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match=r"has 10 bytes but .* says 45 tokens x 2 bytes = 90"):
        IndexedTokens(prefix)
    with open(prefix + ".idx", "wb") as f:
        f.write(b"not an index at all, no sir" * 3)
    with pytest.raises(ValueError, match="not a megazero token index"):
        IndexedTokens(prefix)


def test_pickle_reopens(tmp_path):
    prefix = write(tmp_path / "p", DOCS, 257)
    r = pickle.loads(pickle.dumps(IndexedTokens(prefix)))
    assert r.document(3).tolist() == DOCS[3]


def test_in_memory_matches_file(tmp_path):
    prefix = write(tmp_path / "m", DOCS, 257)
    a, b = IndexedTokens(prefix), InMemoryTokens(DOCS, 257)
    assert (a.num_docs, a.num_tokens) == (b.num_docs, b.num_tokens)
    assert torch.equal(a.doc_offsets, b.doc_offsets)
    assert torch.equal(a.tokens(1, 30), b.tokens(1, 30))
    assert b.document(2).tolist() == DOCS[2]
