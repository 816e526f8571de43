"""Packed documents (data.packed_documents, megazero/models/packed.py): the data marks documents, the model
attends within them with positions restarting, and a packed sample's per-token losses equal those of each
document run alone; with context parallelism too (documents crossing the cp chunks)."""
from __future__ import annotations

import pytest
import torch

from megazero.data.dataset import TokenSampleDataset
from megazero.data.indexed import IndexedTokens, InMemoryTokens
from megazero.models.packed import document_mask, positions_in_documents
from tests.harness import run_ranks

DOCS = [5, 11, 3, 9, 20, 4, 12]  # document lengths: boundaries fall inside and across cp chunks of 32 tokens


def _docs_source(lengths=DOCS, vocab=97, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return InMemoryTokens([torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths], vocab)


def test_samples_carry_their_documents_and_ignore_the_crossing_labels():
    src = _docs_source()
    ds = TokenSampleDataset(src, 16, documents=True)
    s0, s1 = ds[0], ds[1]
    assert s0["doc_ids"].tolist() == [0] * 5 + [1] * 11  # tokens 0-15: document 0 (5), document 1 (11)
    # tokens 5 and 16 (the next sample's first) start documents 1 and 2
    assert (s0["labels"] == -100).nonzero().flatten().tolist() == [4, 15]
    assert torch.equal(s0["input_ids"], TokenSampleDataset(src, 16)[0]["input_ids"])
    assert s1["doc_ids"].tolist() == [0] * 3 + [1] * 9 + [2] * 4  # tokens 16-31: documents 2, 3, 4
    assert (s1["labels"] == -100).nonzero().flatten().tolist() == [2, 11]
    # the last label of a sample whose next token starts a document is ignored too (the window's + 1)
    assert TokenSampleDataset(src, 5, documents=True)[0]["labels"][-1].item() == -100


def test_positions_restart_and_the_mask_is_block_diagonal_causal():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    assert positions_in_documents(docs).tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]
    mask = document_mask(docs)
    assert mask.shape == (2, 1, 6, 6)
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, False]
    assert mask[1, 0, 5].tolist() == [False, True, True, True, True, True]


def _per_token_losses(spec_name, method, cp_size, seq, lengths):
    """This layout's per-token losses of one packed sample, and of each document alone (from cp rank 0 of a
    model built with the same seed): {"packed": (seq,), "alone": [(len,), ...]}."""
    import torch.distributed as dist

    from megazero.context_parallel import token_layout
    from megazero.core.topology import Topology
    from megazero.models.lm import causal_lm_loss
    from megazero.models.pipeline_from_spec import build_pipeline_model
    from megazero.runtime.parallel_context import ParallelContext
    from megazero.core.spec import load_spec

    world = dist.get_world_size() if dist.is_initialized() else 1
    pctx = ParallelContext(Topology(cp=world))
    spec = load_spec(spec_name).replace(seq_len=seq, layers=2)
    model = build_pipeline_model(spec, pctx, seed=3, packed_documents=True, cp_method=method)
    src = _docs_source(lengths, vocab=spec.vocab)
    sample = TokenSampleDataset(src, seq, documents=True)[0]

    def losses(batch):
        logits = model.forward_chunk(0, None, batch)  # (s/cp, b, V)
        labels = batch["labels"]
        mine = token_layout.take(labels, 1, pctx.cp_rank, pctx.cp_size)
        per = causal_lm_loss(logits, mine, pctx.tp_group, spec.vocab, reduction="none")  # (b, s/cp) or (s/cp, b)
        per = per.reshape(-1) if per.shape[0] == 1 else per.t().reshape(-1)
        full = torch.zeros(labels.shape[1])
        full[token_layout.positions(labels.shape[1], pctx.cp_rank, pctx.cp_size)] = per.detach()
        if pctx.cp_size > 1:
            gathered = [torch.zeros_like(full) for _ in range(pctx.cp_size)]
            dist.all_gather(gathered, full, group=pctx.cp_group.pg)
            full = sum(gathered)
        return full

    batch = {k: v.unsqueeze(0) for k, v in sample.items()}
    packed = losses(batch)
    one_document = losses({**batch, "doc_ids": torch.zeros_like(batch["doc_ids"])})  # attention across documents
    alone, start = [], 0
    for n in lengths:  # each document alone, padded to the sequence with a second document that it never sees
        tokens = src.tokens(start, min(n + 1, src.num_tokens - start))
        ids = torch.cat([tokens[:n], torch.zeros(seq - n, dtype=torch.long)])
        labels = torch.full((seq,), -100)
        labels[:n - 1] = tokens[1:n]
        docs = torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(seq - n, dtype=torch.long)])
        alone.append(losses({"input_ids": ids[None], "labels": labels[None], "doc_ids": docs[None]})[:n - 1])
        start += n
        if start >= seq:
            break
    pctx.destroy()
    return {"packed": packed, "alone": alone, "one_document": one_document}


def _compare(out, lengths, seq):
    start = 0
    for n, alone in zip(lengths, out["alone"], strict=True):
        got = out["packed"][start:start + n - 1]
        assert torch.allclose(got, alone, rtol=1e-5, atol=1e-5), (start, n, (got - alone).abs().max())
        start += n
    return start


@pytest.mark.parametrize("spec", ["model_specs/llama.py:debug", "model_specs/gpt.py:debug",
                                  "model_specs/gpt.py:debug-alibi"])
def test_a_packed_sample_scores_each_document_as_if_alone(spec):
    """One process: RoPE (Llama), learned positions (GPT), ALiBi; every document's per-token losses in the packed
    sample equal those of the document alone (the cross-document labels are ignored: not compared)."""
    lengths = [5, 11, 3, 9, 5]
    out = _per_token_losses(spec, "ring", 1, 32, lengths)
    assert _compare(out, lengths, 32) == 33  # every document compared
    # the same sample as one document: the second document's tokens see the first's, and score differently
    assert (out["one_document"][5:15] - out["packed"][5:15]).abs().max() > 1e-3


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_packed_documents_compose_with_context_parallelism(method):
    """cp 2 (4 chunks of 8 tokens): documents of 5, 11, 3, 9 and 5 tokens cross the chunk boundaries; every
    rank's per-token losses, gathered, equal each document alone."""
    lengths = [5, 11, 3, 9, 5]
    for out in run_ranks(_per_token_losses, 2, "model_specs/llama.py:debug", method, 2, 32, lengths):
        assert _compare(out, lengths, 32) == 33  # every document compared


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """Real text in short documents: each non-empty line of a slice of the Python standard library is a document
    (byte tokens; median 32 tokens with its end-of-document token), so a 32-token sample holds 1.7 documents on
    average and boundaries fall anywhere, across cp chunks too."""
    from megazero.data import demo_corpus, preprocess

    prefix = str(tmp_path_factory.mktemp("short_docs") / "lines")
    preprocess(lambda: (line for text in demo_corpus(60_000) for line in text.split("\n") if line.strip()), prefix)
    return prefix


PARITY_LAYOUTS = [  # (name, parallel and other overrides): each against the serial run of the same packed data
    ("cp2-ring-pp4-zb-h1", {"parallel": {"pp": 4, "cp": 2}, "pipeline": {"schedule": "zb-h1"}}),  # middle stages
    ("cp2-ulysses-tp2-sp-zero3-full", {"parallel": {"tp": 2, "cp": 2, "cp_method": "ulysses", "sequence_parallel": True},
                                       "zero": {"stage": 3}, "activation_checkpointing": {"policy": "full"}}),
    ("pp2-interleaved-dp2-selective", {"parallel": {"pp": 2, "dp": 2}, "pipeline": {"schedule": "interleaved", "chunks": 2},
                                       "activation_checkpointing": {"policy": "selective"}}),
]


def _packed_config(corpus, extra):
    cfg = {"precision": "fp32", "gradient_clipping": 1.0,
           "model": {"spec": "model_specs/llama.py:debug", "layers": 4, "seq_len": 32},
           "train": {"micro_batch_size": 1, "global_batch_size": 4, "seed": 1234},
           "optimizer": {"type": "adamw", "lr": 1e-3, "eps": 1e-6, "weight_decay": 0.01},
           "data": {"path": corpus, "packed_documents": True}, "log": {"interval": 1000}}
    for section, values in extra.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


@pytest.mark.parametrize("name,extra", PARITY_LAYOUTS, ids=[n for n, _ in PARITY_LAYOUTS])
def test_packed_documents_train_like_one_process(name, extra, short_documents):
    """Real text in short documents, packed: each layout's per-step losses, gradient norms, first-step gradients
    and parameters equal the serial run's within the fp32 tolerances (megazero.toolbox.parity)."""
    from megazero.core.config import topology_of
    from megazero.engine import load_run_config
    from megazero.toolbox.parity import compare, format_rows, merge_reports, run_layout, serial_overrides

    cfg = _packed_config(short_documents, extra)
    samples = [TokenSampleDataset(IndexedTokens(short_documents), 32, documents=True)[i] for i in range(8)]
    assert sum(int(s["doc_ids"].max()) for s in samples) >= 4  # the corpus's samples hold boundaries
    p = extra["parallel"]
    world = p.get("pp", 1) * p.get("tp", 1) * p.get("dp", 1) * p.get("cp", 1)
    assert topology_of(load_run_config(cfg, world_size=world)).world_size == world
    reference = merge_reports(run_ranks(run_layout, 1, cfg, serial_overrides(4), 2, timeout=300))
    result = merge_reports(run_ranks(run_layout, world, cfg, (), 2, timeout=300))
    rows = compare(result, reference)
    assert all(r["ok"] for r in rows), f"{name}\n{format_rows(rows)}"


def test_packed_documents_need_a_corpus():
    from megazero.core.config import ConfigError
    from megazero.engine import load_run_config

    with pytest.raises(ConfigError, match="data.packed_documents: needs documents, from data.path"):
        load_run_config("configs/debug_llama.yaml", ["data.path=null", "data.packed_documents=true"], world_size=4)
