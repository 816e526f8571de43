"""ModelSpec: spec files loaded by path, flavors, overrides, validation errors before any compute."""
import os
import sys

import pytest

from megazero.runtime.comm import CommStats, GroupHandle
from megazero.core.spec import ModelSpec, SpecError, coerce_overrides, load_spec
from megazero.models import CausalLM, count_params

SPECS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_specs") + os.sep


def test_load_by_path_with_flavor_and_overrides():
    spec = load_spec(SPECS + "gpt.py:debug", overrides={"layers": 6})
    assert spec.layers == 6 and spec.family == "gpt" and spec.hidden == 64
    assert spec.name.endswith("gpt.py:debug")
    assert "model_specs" not in sys.modules and not any(m.startswith("model_specs") for m in sys.modules)
    llama = load_spec(SPECS + "llama.py:debug", ["kv_heads=2", "dropout=0.1", "tie_embeddings=true"])
    assert (llama.kv_heads, llama.dropout, llama.tie_embeddings) == (2, 0.1, True)
    assert llama.num_kv_heads == 2 and llama.ffn == 176 and llama.head_dim == 8


def test_debug_flavors_are_small():
    for ref in ("gpt.py:debug", "llama.py:debug"):
        spec = load_spec(SPECS + ref)
        assert spec.layers <= 4 and 64 <= spec.hidden <= 128 and spec.vocab <= 1024 and 32 <= spec.seq_len <= 64
        spec.validate_layout(4, sequence_parallel=True)
        if spec.family == "gpt":  # tp=8 fits the GPT debug model; Llama keeps GQA (kv_heads=4)
            spec.validate_layout(8, sequence_parallel=True)


def test_unknown_field_names_the_closest_valid_one():
    with pytest.raises(SpecError, match="unknown model spec field 'layrs'; did you mean 'layers'"):
        load_spec(SPECS + "gpt.py:debug", {"layrs": 3})
    with pytest.raises(SpecError, match="did you mean 'kv_heads'"):
        coerce_overrides(["kv_head=2"])
    with pytest.raises(SpecError, match="not of the form key=value"):
        coerce_overrides(["layers"])
    with pytest.raises(SpecError, match="layers='x': expected a value of type int"):
        coerce_overrides(["layers=x"])


def test_bad_flavor_and_file():
    with pytest.raises(SpecError, match="flavor 'debg' is not in .*did you mean 'debug'"):
        load_spec(SPECS + "gpt.py:debg")
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(SPECS + "nope.py:debug")
    with pytest.raises(SpecError, match="names no flavor; choose one of"):
        load_spec(SPECS + "gpt.py")


@pytest.mark.parametrize("fields, message", [
    ({"hidden": 66}, "hidden=66 is not divisible by heads=4"),
    ({"heads": 8, "kv_heads": 3}, "heads=8 is not divisible by kv_heads=3"),
    ({"norm": "batchnorm"}, "norm='batchnorm' is not one of layernorm, rmsnorm"),
    ({"activation": "swiglue"}, "did you mean 'swiglu'"),
    ({"dropout": 1.0}, r"dropout=1.0 must be in \[0, 1\)"),
    ({"layers": 0}, "layers=0 must be a positive integer"),
])
def test_invalid_architecture(fields, message):
    with pytest.raises(SpecError, match=message):
        ModelSpec(**fields)


@pytest.mark.parametrize("fields, tp, sp, message", [
    ({"hidden": 96, "heads": 6}, 4, False, "heads=6 is not divisible by tp=4"),
    ({"hidden": 66, "heads": 6}, 4, False, "hidden=66 is not divisible by tp=4"),
    ({"heads": 8, "kv_heads": 2}, 4, False, "tp=4 > kv_heads=2: replicating KV heads across TP ranks is not supported"),
    ({"heads": 12, "hidden": 96, "kv_heads": 6}, 4, False, "kv_heads=6 is not divisible by tp=4"),
    ({"ffn_hidden": 90}, 4, False, "ffn_hidden=90 is not divisible by tp=4"),
    ({"seq_len": 30}, 4, True, "sequence_parallel needs seq_len=30 divisible by tp=4"),
])
def test_layout_errors_before_any_compute(fields, tp, sp, message):
    spec = ModelSpec(**fields)
    with pytest.raises(SpecError, match=message):
        spec.validate_layout(tp, sequence_parallel=sp)
    group = GroupHandle("tp", tuple(range(tp)), 0, None, CommStats())
    with pytest.raises(SpecError, match=message):  # building the model checks the layout first
        CausalLM(spec, group, sequence_parallel=sp, device="meta")


def test_padded_vocab_and_param_count():
    spec = load_spec(SPECS + "gpt.py:gpt2-small")
    assert spec.padded_vocab(1) == 50304 and spec.padded_vocab(8) == 51200
    assert count_params(spec) == 124_439_808  # GPT-2 small, as Hugging Face counts it
    assert count_params(load_spec(SPECS + "llama.py:llama2-7b")) == 6_738_415_616
