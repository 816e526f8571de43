"""Partitioning layers into (virtual) pipeline stages: every method, exact balance, clear errors."""
import itertools
import re

import pytest
from hypothesis import given, settings, strategies as st

from megazero.core.partition import LayerInfo, partition, part_weights, stage_layers


def gpt(blocks=10, embed_params=1000, block_params=300, head_params=1000):
    return ([LayerInfo("VocabParallelEmbedding", embed_params, 5.0)]
            + [LayerInfo("TransformerBlock", block_params, 10.0) for _ in range(blocks)]
            + [LayerInfo("LMHead", head_params, 8.0)])


def sizes(bounds):
    return [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def test_uniform_gives_extras_to_the_first_stages_and_allows_any_layer_count():
    layers = gpt(blocks=8)  # 10 layers
    assert sizes(partition(layers, 4, "uniform")) == [3, 3, 2, 2]
    assert sizes(partition(layers, 3, "uniform")) == [4, 3, 3]
    assert partition(layers, 1, "uniform") == (0, 10)
    assert sizes(partition(layers, 10, "uniform")) == [1] * 10


def test_parameters_balances_parameter_counts():
    layers = gpt()
    bounds = partition(layers, 4, "parameters")
    assert bounds == (0, 2, 6, 10, 12)
    assert part_weights(layers, bounds) == [1300, 1200, 1200, 1300]


def test_flops_counts_embedding_and_head():
    layers = gpt()
    bounds = partition(layers, 4, "flops")
    assert max(part_weights(layers, bounds, "flops")) == 30  # the best contiguous split of 5, 10 x 10, 8
    heavy_head = layers[:-1] + [LayerInfo("LMHead", 1000, 40.0)]
    assert sizes(partition(heavy_head, 4, "flops"))[-1] == 1  # the head gets a stage of its own


def test_type_regex_balances_matching_layers_case_insensitively():
    layers = gpt(blocks=8)
    bounds = partition(layers, 4, "type:transformerblock")
    counts = [sum(layer.name == "TransformerBlock" for layer in layers[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert counts == [2, 2, 2, 2] and bounds[0] == 0 and bounds[-1] == 10
    assert sizes(partition(layers, 2, "type:Block|Head")) in ([5, 5], [4, 6], [6, 4])


def test_explicit_counts_and_virtual_stages():
    layers = gpt()
    assert partition(layers, 2, [5, 7]) == (0, 5, 12)
    bounds = partition(layers, 2, "type:Block", chunks=3)
    assert len(bounds) == 7
    counts = [sum(layer.name == "TransformerBlock" for layer in layers[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert sorted(counts) == [1, 1, 2, 2, 2, 2]
    # chunk 1 of stage 0 is virtual stage 2 (Megatron layout chunk * p + stage)
    assert stage_layers(bounds, stage=0, num_stages=2, chunk=1) == range(bounds[2], bounds[3])
    assert stage_layers(bounds, stage=1, num_stages=2) == range(bounds[1], bounds[2])


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_stages=13), "cannot split 12 layers into num_stages=13 x chunks=1 = 13 parts"),
    (dict(num_stages=4, chunks=4), "num_stages=4 x chunks=4 = 16 parts"),
    (dict(num_stages=0), "num_stages=0 must be an integer >= 1"),
    (dict(method="param"), "unknown partition method 'param' (pipeline.partition); did you mean 'parameters'?"),
    (dict(method="balanced"), "valid methods are uniform, parameters, flops, type:<regex>, or a list"),
    (dict(method="type:Conv"), "'type:Conv' matches no layer type; the types are LMHead, TransformerBlock, "
                               "VocabParallelEmbedding"),
    (dict(method="type:["), "partition 'type:[': bad regular expression '['"),
    (dict(method=[3, 3, 3]), "has 3 entries but needs one layer count per virtual stage: num_stages x chunks = 4"),
    (dict(method=[3, 3, 3, 4]), "sums to 13 but the model has 12 layers"),
    (dict(method=[6, 0, 3, 3]), "partition[1]=0 must be an integer >= 1"),
])
def test_errors_name_the_argument(kwargs, message):
    kwargs = {"num_stages": 4, **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        partition(gpt(), **kwargs)


def test_weight_errors():
    message = "'parameters' needs per-layer params, but every layer has params=0"
    with pytest.raises(ValueError, match=re.escape(message)):
        partition([LayerInfo("x")] * 4, 2, "parameters")
    with pytest.raises(ValueError, match=re.escape("layer 1 (y) has flops=-1.0; it must be a number >= 0")):
        partition([LayerInfo("x", flops=1.0), LayerInfo("y", flops=-1.0)], 2, "flops")


def brute_force_bottleneck(weights, parts):
    best = None
    for cuts in itertools.combinations(range(1, len(weights)), parts - 1):
        bounds = (0,) + cuts + (len(weights),)
        worst = max(sum(weights[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True))
        best = worst if best is None else min(best, worst)
    return best


@settings(max_examples=150, deadline=None)
@given(weights=st.lists(st.integers(0, 50), min_size=1, max_size=9), parts=st.integers(1, 5), use_flops=st.booleans())
def test_balance_is_optimal(weights, parts, use_flops):
    if parts > len(weights) or not any(weights):
        return
    layers = [LayerInfo(f"L{i}", params=w, flops=w / 7) for i, w in enumerate(weights)]
    bounds = partition(layers, parts, "flops" if use_flops else "parameters")
    assert bounds[0] == 0 and bounds[-1] == len(weights) and all(a < b for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    assert max(part_weights(layers, bounds)) == brute_force_bottleneck(weights, parts)
