"""`megazero.toolbox.model_facts`: per-rank facts of a layout from the meta-device build of every rank.

(a) Dry runs of GPT-3 175B at tp=8 x pp=16 and Llama-3 405B at tp=8 x pp=18 (with sequence
parallelism): the shards of every rank put the full model back together (TP shards of a logical
parameter concatenate along tp_dim to its full dim, the vocabulary to its padded size; replicated
ones are full copies; every logical parameter lives on exactly one pipeline rank, the tied word
embedding / LM head on the first and the last) and `ModelFacts` agrees with them.
(b) On debug flavors, each pipeline rank's facts equal the parameters of a real CPU build of that
stage: from layer_builders + megazero.core.partition directly, and from the trainer's PipelineModule.
"""
import collections
import time
from types import SimpleNamespace

import pytest
import torch

from megazero.core import partition as part
from megazero.core.instructions import virtual_stage
from megazero.core.spec import load_spec
from megazero.core.spec_partition import block_counts_to_layer_counts
from megazero.models import CausalLM, count_params, layer_builders
from megazero.models.pipeline_from_spec import build_pipeline_model
from megazero.planner.facts import ModelFacts, StageFacts
from megazero.runtime.comm import single_rank_group
from megazero.toolbox.model_facts import build_ranks, facts_of, fake_tp_group, model_facts, rank_shards
from tests.test_spec import SPECS

VOCAB = ("embedding.word.weight", "head.weight")  # the split dim of these is the padded vocabulary

DRY_RUNS = {  # id -> (flavor, tp, pp, sequence_parallel)
    "gpt3-175b-tp8-pp16": ("gpt.py:gpt3-175b", 8, 16, False),
    "llama3-405b-tp8-pp18": ("llama.py:llama3-405b", 8, 18, True),
}


@pytest.fixture(scope="module", params=list(DRY_RUNS), ids=list(DRY_RUNS))
def dry_run(request):
    ref, tp, pp, sp = DRY_RUNS[request.param]
    spec = load_spec(SPECS + ref)
    t0 = time.perf_counter()
    ranks = build_ranks(spec, tp, pp, sequence_parallel=sp)
    facts = facts_of(ranks)
    print(f"\n{request.param}: {tp * pp} ranks built on meta in {time.perf_counter() - t0:.2f} s")
    return spec, tp, pp, sp, ranks, facts


def full_model_shapes(spec):
    """{logical name: full shape} of the whole model (pp=1, tp=1, meta device)."""
    model = CausalLM(spec, single_rank_group("tp"), device="meta")
    return {p.logical_name: tuple(p.shape) for p in model.parameters()}


def test_shards_of_every_rank_make_the_full_model(dry_run):
    spec, tp, pp, sp, ranks, _ = dry_run
    full = full_model_shapes(spec)
    where = collections.defaultdict(lambda: collections.defaultdict(dict))  # name -> pp rank -> tp rank -> shard
    for (s, r), rank in ranks.items():
        for p in rank.shards:
            assert p.tp_rank == (r if p.tp_dim is not None else 0) and p.tp_size == (tp if p.tp_dim is not None else 1)
            assert r not in where[p.name][s], f"{p.name} twice on rank ({s}, {r})"
            where[p.name][s][r] = p
    assert where.keys() == full.keys()
    tied = {"embedding.word.weight"} if spec.tie_embeddings else set()
    for name, stages in where.items():
        if name in tied:  # a copy on the first and on the last stage
            assert sorted(stages) == [0, pp - 1], name
        else:
            assert len(stages) == 1, f"{name} on pipeline ranks {sorted(stages)}"
        assert name not in tied or all(p.tied for sh in stages.values() for p in sh.values())
        for s, shards in stages.items():
            assert sorted(shards) == list(range(tp)), f"{name} on pp rank {s}: TP ranks {sorted(shards)}"
            ps = [shards[r] for r in range(tp)]
            assert all(p.full_shape == full[name] for p in ps)
            assert all(p.sequence_parallel == (sp and p.tp_dim is None) for p in ps), name
            d = ps[0].tp_dim
            if d is None:
                assert all(p.shape == full[name] for p in ps), name
                continue
            assert all(p.tp_dim == d for p in ps)
            for other in range(len(full[name])):
                if other != d:
                    assert all(p.shape[other] == full[name][other] for p in ps), name
            joined = sum(p.shape[d] for p in ps)
            assert joined == (spec.padded_vocab(tp) if name in VOCAB else full[name][d]), name


def test_model_facts_agree_with_the_shards(dry_run):
    spec, tp, pp, _, ranks, facts = dry_run
    assert isinstance(facts, ModelFacts) and len(facts.stages) == pp
    assert facts.total_params == count_params(spec)
    assert sum(st.layers for st in facts.stages) == spec.layers
    assert [st.stage for st in facts.stages] == list(range(pp))
    assert [st.embedding for st in facts.stages] == [True] + [False] * (pp - 1)
    assert [st.head for st in facts.stages] == [False] * (pp - 1) + [True]
    word = spec.padded_vocab(tp) // tp * spec.hidden  # one TP rank's rows of the word embedding
    tied = [word if spec.tie_embeddings and s in (0, pp - 1) else 0 for s in range(pp)]
    assert [st.tied_params for st in facts.stages] == tied
    for s, st in enumerate(facts.stages):
        assert all(sum(p.numel for p in ranks[s, r].shards) == st.params for r in range(tp))
    # what the uniform partition gives: pp*1 parts of the L+2 layers, the first (L+2) % pp one longer
    size, extra = divmod(spec.layers + 2, pp)
    per_part = [size + (i < extra) for i in range(pp)]
    assert [st.layers for st in facts.stages] == [per_part[0] - 1] + per_part[1:-1] + [per_part[-1] - 1]


def _stage_params_from_builders(spec, tp, r, pp, s, chunks, partition, sp):
    """Parameters of TP rank r on pipeline rank s, built for real on the CPU straight from
    layer_builders and megazero.core.partition: ([(logical name, shape)], blocks, embedding?, head?)."""
    builders = layer_builders(spec, fake_tp_group(tp, r), sequence_parallel=sp)
    infos = [part.LayerInfo({"embedding": "EmbeddingLayer", "block": "TransformerBlock", "head": "HeadLayer"}[b.kind],
                            b.num_params()) for b in builders]
    method = block_counts_to_layer_counts(partition, [b.kind for b in builders]) \
        if isinstance(partition, list) else partition
    bounds = part.partition(infos, pp, method, chunks)
    mine = [builders[i] for c in range(chunks)
            for i in range(bounds[virtual_stage(s, c, pp)], bounds[virtual_stage(s, c, pp) + 1])]
    kinds = [b.kind for b in mine]
    shared = spec.tie_embeddings and "embedding" in kinds and "head" in kinds  # one parameter on one stage
    shapes = [(p.logical_name, tuple(p.shape)) for b in mine for n, p in b(torch.device("cpu")).named_parameters()
              if not (shared and b.kind == "head" and n == "weight")]
    return shapes, kinds.count("block"), "embedding" in kinds, "head" in kinds


CASES = [  # (flavor, overrides, tp, pp, chunks, partition, sequence_parallel)
    ("gpt.py:debug", None, 2, 2, 1, "uniform", False),
    ("gpt.py:debug", {"layers": 6}, 2, 3, 2, "parameters", True),
    ("gpt.py:debug-bloom", {"layers": 5}, 4, 2, 1, [3, 2], True),
    ("gpt.py:debug-bloom", None, 2, 1, 2, "uniform", False),  # pp=1: the head shares the embedding's weight
    ("llama.py:debug", {"layers": 4}, 4, 2, 2, "type:TransformerBlock", False),
]


@pytest.mark.parametrize("ref, overrides, tp, pp, chunks, partition, sp", CASES)
def test_debug_stage_facts_equal_a_real_build(ref, overrides, tp, pp, chunks, partition, sp):
    spec = load_spec(SPECS + ref, overrides)
    ranks = build_ranks(spec, tp, pp, chunks=chunks, partition=partition, sequence_parallel=sp)
    facts = facts_of(ranks)
    assert facts == model_facts(spec, tp, pp, chunks=chunks, partition=partition, sequence_parallel=sp)
    assert facts.total_params == count_params(spec)
    for s, st in enumerate(facts.stages):
        for r in range(tp):
            shapes, blocks, emb, head = _stage_params_from_builders(spec, tp, r, pp, s, chunks, partition, sp)
            n = sum(torch.Size(shape).numel() for _, shape in shapes)
            assert st == StageFacts(s, blocks, n, st.tied_params, emb, head), (s, r)
            assert shapes == [(p.name, p.shape) for p in ranks[s, r].shards], (s, r)
            pctx = SimpleNamespace(tp_group=fake_tp_group(tp, r), tp_rank=r, tp_size=tp, pp_rank=s, pp_size=pp)
            module = build_pipeline_model(spec, pctx, sequence_parallel=sp, partition=partition, chunks=chunks)
            assert sum(p.numel() for p in module.parameters()) == st.params
            assert [(p.logical_name, tuple(p.shape)) for p in module.parameters()] == \
                [(p.name, p.shape) for p in ranks[s, r].shards]  # the same layers (chunks), in order
            tied = sum(p.numel() for p in module.parameters() if getattr(p, "tied_name", None) is not None)
            assert st.tied_params == (tied if pp > 1 else 0)


def test_rank_shards_names_every_parameter_of_a_rank():
    spec = load_spec(SPECS + "gpt.py:debug-bloom")
    shards = rank_shards(spec, tp=2, pp=2)
    assert sorted(shards) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    first = {p.name for p in shards[0, 1]}
    assert {"embedding.word.weight", "embedding.norm.weight", "embedding.norm.bias", "layers.0.attn.q.weight"} <= first
    last = {p.name for p in shards[1, 0]}
    assert {"embedding.word.weight", "head.norm.weight", "layers.1.mlp.fc2.weight"} <= last
    assert "embedding.position.weight" not in first  # ALiBi: no learned positions
