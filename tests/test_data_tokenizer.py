"""Tokenizers: byte-level and locally trained BPE round-trips, save/load by path, vocab checks."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megazero.data.tokenizer import (BYTE_VOCAB_SIZE, BPETokenizer, ByteTokenizer, check_vocab, load_tokenizer,
                                     tokenizer_path)

TEXTS = ["", "hello world", "naïve café ☕ — 日本語 🙂\n\ttabs", "def f(x):\n    return x + 1\n"]

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
] * 20


def test_byte_tokenizer_constants():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eod_id, tok.name) == (257, 256, "byte") and BYTE_VOCAB_SIZE == 257


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eod_id]) == text  # special ids are dropped


@settings(max_examples=50, deadline=None)
@given(st.text())
def test_byte_round_trip_any_text(text):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_byte_save_load(tmp_path):
    path = str(tmp_path / "sub" / "tok.json")
    ByteTokenizer().save(path)
    tok = load_tokenizer(path)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 257
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert tokenizer_path("data/x") == "data/x.tokenizer.json"


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train(CORPUS, vocab_size=300)


def test_bpe_trains_locally_and_round_trips(bpe):
    assert bpe.name == "bpe" and bpe.vocab_size == 300
    assert 0 <= bpe.eod_id < bpe.vocab_size
    for text in TEXTS + CORPUS[:4]:
        ids = bpe.encode(text)
        assert all(0 <= i < bpe.vocab_size for i in ids)
        assert bpe.decode(ids) == text
    # merges compress the training text
    assert len(bpe.encode(CORPUS[1])) < len(CORPUS[1].encode("utf-8")) // 2
    assert bpe.encode_batch(CORPUS[:2]) == [bpe.encode(CORPUS[0]), bpe.encode(CORPUS[1])]
    assert bpe.decode(bpe.encode("x = 1") + [bpe.eod_id]) == "x = 1"


def test_bpe_save_load(bpe, tmp_path):
    path = str(tmp_path / "bpe.tokenizer.json")
    bpe.save(path)
    loaded = load_tokenizer(path)
    assert isinstance(loaded, BPETokenizer)
    assert (loaded.vocab_size, loaded.eod_id) == (bpe.vocab_size, bpe.eod_id)
    for text in TEXTS:
        assert loaded.encode(text) == bpe.encode(text)


def test_bpe_training_is_deterministic(bpe):
    again = BPETokenizer.train(CORPUS, vocab_size=300)
    assert again.encode(CORPUS[1] + CORPUS[3]) == bpe.encode(CORPUS[1] + CORPUS[3])


def test_bpe_vocab_too_small():
    with pytest.raises(ValueError, match=r"--vocab-size 100 is too small for BPE: need at least 257"):
        BPETokenizer.train(CORPUS, vocab_size=100)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="must be loaded from its file"):
        load_tokenizer("bpe")
    with pytest.raises(FileNotFoundError, match=r"'nope.json' is neither a kind \(byte, bpe\)"):
        load_tokenizer("nope.json")


def test_check_vocab():
    check_vocab(257, 257)
    check_vocab(257, 264)  # padded model vocab is fine
    with pytest.raises(ValueError) as e:
        check_vocab(257, 256, "byte")
    msg = str(e.value)
    assert "model.vocab=256" in msg and "257" in msg and "'byte'" in msg and "\n" not in msg
