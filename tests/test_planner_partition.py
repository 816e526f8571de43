"""The planner plans the partition the trainer runs: uneven splits, ``pipeline.partition`` methods and block
count lists, the interleaved chunk count chosen when not given.

* the planner's pure layer counts (stages.py) are the trainer's (`pipeline_layer_infos`, meta build), so
  the trainer's own partition function gives both the same split: every generated (spec, pp, chunks,
  partition) case gives the planner the blocks, embedding and head per stage the meta-built model has,
  and the planner's parameter lists equal the meta-built counts stage by stage (`predict_memory`'s check);
* the fast `model_facts` equals the rank-by-rank build (`facts_of(build_ranks(...))`);
* layouts that do not divide (70 layers over 12 stages, Llama 3's 126 over 16 with interleaving) are
  planned, per stage, and a stage with more blocks is predicted to need more memory and time;
* a partition the trainer refuses, the planner refuses with the trainer's reason.
"""
from __future__ import annotations

import itertools

import pytest

from megazero.core.spec import load_spec
from megazero.core.spec_partition import layer_kinds
from megazero.models.pipeline_from_spec import pipeline_layer_infos
from megazero.planner import stages
from megazero.planner.hardware import load_hardware
from megazero.planner.layout import Layout
from megazero.planner.memory_plan import predict_memory
from megazero.planner.speed import predict_step
from megazero.toolbox.model_facts import build_ranks, facts_of, model_facts
from tests.test_spec import SPECS

A100 = load_hardware("a100-80gb", "configs/hardware")
FLAVORS = [("gpt.py:debug", {"layers": 5}), ("gpt.py:debug-bloom", {"layers": 4, "tie_embeddings": False}),
           ("llama.py:debug", {"layers": 6}), ("llama.py:debug-moe", {"layers": 3}),
           ("llama.py:debug-deepseek", {"layers": 4})]
METHODS = ["uniform", "parameters", "flops", "type:TransformerBlock"]


def _cases():
    """Every flavor x (pp, chunks) x method, and a block-count list per (pp, chunks) (the first stage's
    blocks moved to the last where it can), where the parts fit the L + 2 layers."""
    for (ref, over), pp, chunks in itertools.product(FLAVORS, (1, 2, 3), (1, 2)):
        layers = over["layers"]
        parts = pp * chunks
        if parts > layers + 2 or (chunks > 1 and pp == 1):
            continue
        for method in METHODS:
            yield ref, over, pp, chunks, method
        if parts <= layers:
            counts = [layers // parts + (i < layers % parts) for i in range(parts)]
            if parts > 1 and counts[0] > 1:
                counts[0], counts[-1] = counts[0] - 1, counts[-1] + 1
            yield ref, over, pp, chunks, tuple(counts)


CASES = list(_cases())


def test_the_planners_layer_counts_are_the_trainers():
    for ref, over in FLAVORS:
        spec = load_spec(SPECS + ref, over)
        infos = pipeline_layer_infos(spec)
        assert [i.params for i in infos] == [stages.logical_params(spec)[k] for k in layer_kinds(spec)], ref


@pytest.mark.parametrize("ref, over, pp, chunks, partition", CASES, ids=[
    f"{r.split(':')[1]}-pp{p}-v{c}-{m if isinstance(m, str) else '.'.join(map(str, m))}" for r, _, p, c, m in CASES])
def test_planner_and_trainer_split_alike(ref, over, pp, chunks, partition):
    spec = load_spec(SPECS + ref, over)
    tp = 2
    facts = model_facts(spec, tp, pp, chunks, partition)
    assert facts == facts_of(build_ranks(spec, tp, pp, chunks, list(partition) if isinstance(partition, tuple)
                                         else partition))
    layout = Layout(tp=tp, pp=pp, dp=2, global_batch=2 * 2 * pp * 2, chunks=chunks, partition=partition,
                    schedule="interleaved" if chunks > 1 else "1f1b", zero=1)
    assert layout.problems(spec) == []
    planned = stages.pipeline_layers(spec, layout)
    for st, chunk_layers in zip(facts.stages, planned, strict=True):
        kinds = [kind for chunk in chunk_layers for kind, _ in chunk]
        assert (kinds.count("block"), "embedding" in kinds, "head" in kinds) == (st.layers, st.embedding, st.head)
    predict_memory(spec, layout, facts, device="cpu")  # raises unless each stage's parameters equal the facts'
    plan = predict_step(spec, layout, A100, facts)
    assert plan.step_time_s > 0 and len(plan.stage_costs) == pp


GPT = load_spec(SPECS + "gpt.py:debug", {"layers": 70, "hidden": 1024, "heads": 16, "seq_len": 512, "vocab": 50000})
LLAMA = load_spec(SPECS + "llama.py:debug", {"layers": 126, "hidden": 1024, "heads": 16, "kv_heads": 8,
                                             "ffn_hidden": 3584, "seq_len": 512, "vocab": 32000})


@pytest.mark.parametrize("spec, layout", [
    (GPT, Layout(tp=1, pp=12, dp=1, global_batch=24, micro_batch=1)),  # BLOOM's 70 layers over 12 stages
    (LLAMA, Layout(tp=1, pp=16, dp=1, global_batch=32, schedule="interleaved", chunks=4)),
    (LLAMA, Layout(tp=1, pp=16, dp=1, global_batch=32, partition=(7,) + (8,) * 14 + (7,))),  # Llama 3's split
])
def test_layouts_that_do_not_divide_are_planned_per_stage(spec, layout):
    assert spec.layers % layout.virtual_stages  # the planner refused these before
    memory = predict_memory(spec, layout)
    step = predict_step(spec, layout, A100)
    blocks = [sum(b) for b in stages.blocks_per_chunk(spec, layout)]
    assert sum(blocks) == spec.layers and len(set(blocks)) > 1
    inner = range(1, layout.pp - 1)  # no embedding or head: a stage with more blocks costs more
    for a, b in itertools.combinations(inner, 2):
        if blocks[a] != blocks[b]:
            more, fewer = (a, b) if blocks[a] > blocks[b] else (b, a)
            assert sum(step.stage_costs[more]) > sum(step.stage_costs[fewer])
            params = {s.stage: s.breakdown["params"] for s in memory.stages}
            assert params[more] > params[fewer]


def test_moving_blocks_off_the_ends_balances_the_pipeline():
    """Llama 3's split (one block fewer on the first and the last stage) against 8 blocks on each of the
    first 15 stages: stage 0's 8 blocks and the embedding set the pace there; at Llama 3's proportions
    the head costs about 0.6 of a block, so 7 blocks and the head on the last stage do not."""
    spec = LLAMA.replace(hidden=4096, heads=32, ffn_hidden=14336)
    even = Layout(tp=1, pp=16, dp=1, global_batch=64, partition=(8,) * 15 + (6,))
    llama3 = even.replace(partition=(7,) + (8,) * 14 + (7,))
    costs = [predict_step(spec, lay, A100).stage_costs for lay in (even, llama3)]
    assert sum(costs[1][0]) < sum(costs[0][0])  # the first stage: a block fewer
    assert max(sum(c) for c in costs[1]) < max(sum(c) for c in costs[0])  # was stage 0: 8 blocks and the embedding
    assert sum(costs[1][-1]) < max(sum(c) for c in costs[1])  # 7 blocks and the head: not the slowest


@pytest.mark.parametrize("partition, words", [
    ((8,) * 15 + (5,), "layer counts sum to 125, not model.layers=126"),
    ((8,) * 15, "15 layer counts for parallel.pp x pipeline.chunks = 16 stages"),
    ((10, 0) + (8,) * 14, "stage 1 has 0 transformer layers"),
    ("blocks", "'blocks' is not valid"),
    ("type:(", "has an invalid regular expression"),
    ("type:Nothing", "matches no layer type"),
])
def test_partitions_the_trainer_refuses_the_planner_refuses_alike(partition, words):
    errs = Layout(tp=1, pp=16, dp=1, global_batch=16, partition=partition).problems(LLAMA)
    assert any(words in e for e in errs), errs


def test_more_parts_than_layers_is_the_trainers_message():
    spec = load_spec(SPECS + "gpt.py:debug")  # 2 blocks: 4 pipeline layers
    errs = Layout(pp=2, dp=1, global_batch=4, schedule="interleaved", chunks=3).problems(spec)
    assert any("cannot split 4 layers into num_stages=2 x chunks=3" in e for e in errs), errs


def test_search_tries_megatrons_even_split_where_the_blocks_divide():
    from megazero.planner.search import _partitions

    gpt = load_spec(SPECS + "gpt.py:debug", {"layers": 96, "hidden": 1024, "heads": 16, "vocab": 50000})
    assert (12,) * 8 in _partitions(gpt, 8, 1, {})  # 96 blocks over 8 stages (flops: fewer on the last, the head
    # costs 4 blocks here); where two splits are the same (a small vocabulary: flops is even) one is kept
    assert _partitions(gpt.replace(vocab=512), 8, 1, {}) == ["uniform", "flops"]
    assert _partitions(gpt, 8, 1, {"partition": "flops"}) == ["flops"]
    assert not any(isinstance(p, tuple) for p in _partitions(gpt.replace(layers=70), 12, 1, {}))  # 70 / 12
