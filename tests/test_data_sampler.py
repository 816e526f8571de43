"""Fixed-length samples and the dp-sharded micro-batch iterator: exact slices, resume, determinism."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megazero.data.dataset import SampleOrder, TokenSampleDataset, epoch_permutation
from megazero.data.indexed import DataPathError, IndexedWriter, InMemoryTokens
from megazero.data.sampler import MicroBatchIterator, NoDataIterator, WorkerMicroBatches, build_data_iterator

VOCAB = 1000


def stream_source(num_tokens, docs=3):
    """Documents whose concatenation is 0, 1, 2, ... (token value = stream position)."""
    cuts = [num_tokens * i // docs for i in range(docs + 1)]
    return InMemoryTokens([list(range(cuts[i], cuts[i + 1])) for i in range(docs)], VOCAB)


class CountingSource(InMemoryTokens):
    """Records every tokens() read."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.reads = []

    def tokens(self, start, length):
        self.reads.append((start, length))
        return super().tokens(start, length)


def test_samples_are_shifted_windows_of_the_stream():
    ds = TokenSampleDataset(stream_source(103), seq_len=10)
    assert len(ds) == 10  # (103 - 1) // 10
    for i in range(len(ds)):
        s = ds[i]
        assert s["input_ids"].dtype == torch.int64 and s["input_ids"].shape == (10,)
        assert s["input_ids"].tolist() == list(range(10 * i, 10 * i + 10))
        assert s["labels"].tolist() == list(range(10 * i + 1, 10 * i + 11))
    assert ds[-1]["input_ids"].tolist() == ds[9]["input_ids"].tolist()
    with pytest.raises(IndexError, match=r"sample 10 outside \[0, 10\)"):
        ds[10]


def test_exact_fit_and_too_short():
    assert len(TokenSampleDataset(stream_source(11), seq_len=10)) == 1
    with pytest.raises(ValueError, match=r"seq_len=10 needs at least 11 tokens .* has only 10 tokens"):
        TokenSampleDataset(stream_source(10), seq_len=10)


def test_shuffled_order_is_a_deterministic_permutation_per_epoch():
    p0 = epoch_permutation(50, seed=1, epoch=0)
    assert sorted(p0.tolist()) == list(range(50))
    assert torch.equal(p0, epoch_permutation(50, seed=1, epoch=0))
    assert not torch.equal(p0, epoch_permutation(50, seed=1, epoch=1))
    assert not torch.equal(p0, epoch_permutation(50, seed=2, epoch=0))
    order = SampleOrder(50, seed=1)
    assert [order.index(p) for p in range(50)] == p0.tolist()
    assert [order.index(50 + p) for p in range(50)] == epoch_permutation(50, 1, 1).tolist()
    assert [SampleOrder(50, 1, shuffle=False).index(p) for p in range(120)] == [p % 50 for p in range(120)]


def make_iters(ds, m, gas, dp, seed=7, start_step=0, shuffle=True):
    return [MicroBatchIterator(ds, m, gas, r, dp, seed, start_step=start_step, shuffle=shuffle) for r in range(dp)]


def first_tokens(batch, seq_len):
    """The sample index of each row (inputs start at i * seq_len in the 0, 1, 2, ... stream)."""
    return [int(row[0]) // seq_len for row in batch["input_ids"]]


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 3), gas=st.integers(1, 3), dp=st.integers(1, 4), seed=st.integers(0, 99),
       shuffle=st.booleans(), samples=st.integers(1, 40))
def test_union_over_dp_ranks_is_the_global_batch(m, gas, dp, seed, shuffle, samples):
    seq = 4
    ds = TokenSampleDataset(stream_source(samples * seq + 1), seq)
    order = SampleOrder(len(ds), seed, shuffle)
    iters = make_iters(ds, m, gas, dp, seed, shuffle=shuffle)
    B = m * gas * dp
    for step in range(3):
        got = []
        for r, it in enumerate(iters):
            for j in range(gas):
                assert (it.step, it.micro) == (step, j)
                batch = next(it)
                assert batch["input_ids"].shape == (m, seq) and batch["labels"].shape == (m, seq)
                assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
                got.append((r, j, first_tokens(batch, seq)))
        # rank r, micro-batch j holds positions k*B + (r*gas + j)*m + [0, m): disjoint, in order
        flat = [i for _, _, rows in sorted(got) for i in rows]
        assert flat == [order.index(p) for p in range(step * B, (step + 1) * B)]


def test_layout_formula_and_epoch_wrap():
    ds = TokenSampleDataset(stream_source(10 * 3 + 1), 3)  # 10 samples
    it = MicroBatchIterator(ds, 2, 2, dp_rank=1, dp_size=2, seed=0, shuffle=False)
    assert it.global_batch_size == 8
    assert list(it.positions(0, 0)) == [4, 5] and list(it.positions(0, 1)) == [6, 7]
    assert list(it.positions(1, 1)) == [14, 15]
    assert first_tokens(it.micro_batch(1, 1), 3) == [4, 5]  # positions 14, 15 wrap into epoch 1
    with pytest.raises(IndexError, match="micro-batch 2 outside"):
        it.positions(0, 2)


def test_resume_equals_continuing_and_reads_nothing_skipped():
    seq, k = 8, 5
    src = CountingSource([list(range(0, 150)), list(range(150, 401))], VOCAB)
    ds = TokenSampleDataset(src, seq)  # 50 samples, B = 12: steps 5 and 6 lie in epoch 1
    cont = MicroBatchIterator(ds, 2, 3, 1, 2, seed=3)
    continued = [next(cont) for _ in range(3 * (k + 2))][3 * k:]
    src.reads.clear()
    resumed_it = MicroBatchIterator(ds, 2, 3, 1, 2, seed=3, start_step=k)
    first = next(resumed_it)
    assert len(src.reads) == 2  # exactly the two samples of that micro-batch
    resumed = [first] + [next(resumed_it) for _ in range(5)]
    for a, b in zip(continued, resumed, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert resumed_it.state_dict() == {"step": k + 2, "micro": 0, "seed": 3, "global_batch_size": 12}


def test_same_seed_same_batches_other_seed_differs():
    ds = TokenSampleDataset(stream_source(401), 4)
    run = [[next(it)["input_ids"] for _ in range(6)] for it in (MicroBatchIterator(ds, 2, 3, 0, 1, seed=s)
                                                                for s in (11, 11, 12))]
    assert all(torch.equal(a, b) for a, b in zip(run[0], run[1], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(run[0], run[2], strict=True))


@pytest.fixture
def data_prefix(tmp_path):
    prefix = str(tmp_path / "tok")
    with IndexedWriter(prefix, 257, "byte", eod_appended=True) as w:
        w.add_document(list(range(100)) + [256])
        w.add_document(list(range(50)) + [256])
    return prefix


def test_build_data_iterator(data_prefix):
    it = build_data_iterator(data_prefix, seq_len=10, micro_batch_size=2, gradient_accumulation_steps=2,
                             dp_rank=0, dp_size=2, seed=1, start_step=3, model_vocab=257)
    assert isinstance(it, MicroBatchIterator) and len(it.dataset) == 15 and it.step == 3
    batch = next(it)
    assert batch["input_ids"].shape == (2, 10) and int(batch["input_ids"].max()) <= 256
    with pytest.raises(ValueError, match="model.vocab=256 is smaller than the data's vocab 257"):
        build_data_iterator(data_prefix, 10, 2, 2, 0, 2, 1, model_vocab=256)
    with pytest.raises(ValueError, match=r"seq_len=500 needs at least 501 tokens .* has only 152 tokens"):
        build_data_iterator(data_prefix, 500, 2, 2, 0, 2, 1)


def test_middle_stages_do_not_touch_the_data(tmp_path):
    it = build_data_iterator(str(tmp_path / "absent"), 10, 2, 2, dp_rank=1, dp_size=2, seed=1, start_step=4,
                             needs_data=False)
    assert isinstance(it, NoDataIterator) and it.state_dict() == {"step": 4, "micro": 0}
    with pytest.raises(RuntimeError, match="needs_data=False"):
        next(it)


def test_build_data_iterator_errors(tmp_path):
    with pytest.raises(DataPathError, match=r"create it with: python tools/preprocess_data.py"):
        build_data_iterator(str(tmp_path / "absent"), 10, 2, 2, 0, 1, 1)
    bad = [(dict(dp_rank=2), r"dp_rank=2 must be an integer in \[0, dp_size=2\)"),
           (dict(micro_batch_size=0), "micro_batch_size=0 must be an integer >= 1"),
           (dict(gradient_accumulation_steps=1.5), "gradient_accumulation_steps=1.5 must be an integer"),
           (dict(start_step=-1), "start_step=-1 must be an integer >= 0"),
           (dict(seq_len=0), "seq_len=0 must be a positive integer")]
    for override, msg in bad:
        kw = dict(path_prefix="x", seq_len=10, micro_batch_size=2, gradient_accumulation_steps=2, dp_rank=0,
                  dp_size=2, seed=1, needs_data=False)
        kw.update(override)
        with pytest.raises(ValueError, match=msg):
            build_data_iterator(**kw)


def _taken(it, n):
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("start_step", [0, 3])
def test_worker_processes_read_the_same_micro_batches_in_the_same_order(data_prefix, start_step):
    """data.num_workers 2 against 0: the same 10 micro-batches (40 sample positions over the 15 samples at gas 2,
    micro 2, dp 2: two wraps into a new permutation included), bit for bit, and the same position after."""
    args = dict(path_prefix=data_prefix, seq_len=10, micro_batch_size=2, gradient_accumulation_steps=2, dp_rank=1,
                dp_size=2, seed=7, start_step=start_step)
    plain, workers = build_data_iterator(**args), build_data_iterator(**args, num_workers=2)
    assert isinstance(workers, WorkerMicroBatches) and workers.num_workers == 2
    a, b = _taken(plain, 10), _taken(workers, 10)
    assert len(a) == len(b) == 10
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert workers.state_dict() == plain.state_dict() == {"step": start_step + 5, "micro": 0, "seed": 7,
                                                          "global_batch_size": 8}
    with pytest.raises(ValueError, match="num_workers=-1 must be an integer >= 1"):
        WorkerMicroBatches(plain, -1)


def test_the_config_key_reaches_the_trainers_data(data_prefix):
    """``data.num_workers=2`` through `megazero.initialize` (one rank, a spec model reading `data.path`): the
    engine's data is read by workers and is the same as with the key at 0, from a resumed step too."""
    import megazero
    from megazero.engine import data_iterator, load_run_config

    base = ["parallel.pp=1", "parallel.tp=1", f"data.path={data_prefix}", "model.seq_len=10",
            "train.micro_batch_size=2", "train.global_batch_size=4"]
    cfg = {n: load_run_config("configs/debug_gpt.yaml", base + [f"data.num_workers={n}"], world_size=1) for n in (0, 2)}
    engine, _, data, _ = megazero.initialize(config=cfg[2])
    assert isinstance(data, WorkerMicroBatches)
    for start in (0, 4):
        got = _taken(data if start == 0 else data_iterator(cfg[2], engine, start), 4)
        want = _taken(data_iterator(cfg[0], engine, start), 4)
        for x, y in zip(got, want, strict=True):
            assert all(torch.equal(x[k], y[k]) for k in ("input_ids", "labels"))
