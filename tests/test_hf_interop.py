"""Interop with Hugging Face transformers: load GPT2LMHeadModel / LlamaForCausalLM weights into megazero
at tp=1 and tp=2, compare logits (max |megazero - HF| <= 1e-4, measured ~1e-6), and export back
(bit-exact round trip). HF models are built from small configs with random weights; nothing is
downloaded. Every weight (biases and norm gains included) is perturbed so a mis-mapped tensor shows.
"""
import numpy as np
import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from megazero.runtime.comm import single_rank_group  # noqa: E402
from megazero.models import CausalLM  # noqa: E402
from megazero.models.hf import (export_hf_state_dict, hf_to_logical, load_hf_state_dict,  # noqa: E402
                                spec_from_hf_config)
from megazero.runtime.parallel_context import ParallelContext  # noqa: E402
from megazero.core.spec import SpecError  # noqa: E402
from megazero.tensor_parallel import gather_from_tp_region  # noqa: E402
from megazero.core.topology import Topology  # noqa: E402
from tests.harness import run_ranks  # noqa: E402

TOL = 1e-4
VOCAB = 1001  # not divisible by 2: the padded vocabulary is exercised


def _perturb(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def make_hf(kind, tie=False):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return _perturb(transformers.GPT2LMHeadModel(cfg), 1)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=tie, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                                   bos_token_id=0, eos_token_id=0)
    return _perturb(transformers.LlamaForCausalLM(cfg), 2)


TOKENS = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))


def megazero_logits(spec, hf_state, group):
    """Full logits (b, s, V) of a megazero model loaded from `hf_state`, and its HF export."""
    model = CausalLM(spec, group).eval()
    load_hf_state_dict(model, hf_state, spec)
    with torch.no_grad():
        logits = gather_from_tp_region(model(TOKENS), group)[..., :spec.vocab]  # (s, b, V)
    return logits.transpose(0, 1), export_hf_state_dict(model, spec, group)


def _tp2_worker(spec, hf_state_np):
    group = ParallelContext(Topology(tp=2)).tp_group
    hf_state = {k: torch.from_numpy(v) for k, v in hf_state_np.items()}
    logits, exported = megazero_logits(spec, hf_state, group)
    if dist.get_rank() != 0:
        return None
    return logits.numpy(), {k: v.numpy() for k, v in exported.items()}


def _check(hf, logits, exported):
    with torch.no_grad():
        ref = hf(TOKENS).logits
    err = (logits - ref).abs().max().item()
    assert err <= TOL, f"max |megazero - HF| logits = {err:.3g}"
    original = hf.state_dict()
    assert exported.keys() == original.keys()
    for k, v in original.items():
        assert torch.equal(torch.as_tensor(exported[k]), v), f"{k} does not round-trip exactly"
    return err


@pytest.mark.parametrize("kind, tie", [("gpt2", True), ("llama", False), ("llama", True)])
def test_logits_and_round_trip_tp1(kind, tie):
    hf = make_hf(kind, tie)
    spec = spec_from_hf_config(hf.config)
    assert spec.tie_embeddings == tie and spec.vocab == VOCAB
    logits, exported = megazero_logits(spec, hf.state_dict(), single_rank_group("tp"))
    _check(hf, logits, exported)
    # re-import of the export gives the same logical tensors
    again = hf_to_logical(exported, spec)
    for k, v in hf_to_logical(hf.state_dict(), spec).items():
        assert torch.equal(again[k], v), k


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_logits_and_round_trip_tp2(kind):
    hf = make_hf(kind)
    spec = spec_from_hf_config(hf.config)
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    logits, exported = run_ranks(_tp2_worker, 2, spec, state, timeout=60)[0]
    _check(hf, torch.from_numpy(np.asarray(logits)), {k: torch.from_numpy(v) for k, v in exported.items()})


def test_unsupported_hf_configs_are_named():
    cfg = transformers.GPT2Config(activation_function="silu")
    with pytest.raises(SpecError, match="activation_function='silu' is not supported"):
        spec_from_hf_config(cfg)
    with pytest.raises(SpecError, match="model_type='bert' is not supported"):
        spec_from_hf_config(transformers.BertConfig())
    hf = make_hf("llama")
    with pytest.raises(KeyError, match="state dict has no 'model.layers.0.self_attn.q_proj.weight'"):
        load_hf_state_dict(CausalLM(spec_from_hf_config(hf.config), single_rank_group("tp")),
                           {k: v for k, v in hf.state_dict().items() if "q_proj" not in k},
                           spec_from_hf_config(hf.config))


def make_mixtral():
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32,
                                     num_local_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0,
                                     rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    return _perturb(transformers.MixtralForCausalLM(cfg), 4)


def test_mixtral_logits_export_and_from_pretrained(tmp_path):
    """A Hugging Face Mixtral (transformers' fused in-memory experts) loads into megazero's MoE model with
    the same logits; the export is the published per-expert layout, which `from_pretrained` reads back to
    the same model, and which megazero imports to the same tensors, bit for bit."""
    from safetensors.torch import save_file

    from megazero.models.hf import hf_config_dict, logical_to_hf

    hf = make_mixtral()
    spec = spec_from_hf_config(hf.config)
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.ffn, spec.moe.z_loss_coef) == (4, 2, 48, 0.0)
    logits, exported = megazero_logits(spec, hf.state_dict(), single_rank_group("tp"))
    with torch.no_grad():
        ref = hf(TOKENS).logits
    assert (logits - ref).abs().max().item() <= TOL
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in exported
    mine, again = hf_to_logical(hf.state_dict(), spec), hf_to_logical(exported, spec)
    assert mine.keys() == again.keys() and all(torch.equal(again[k], v) for k, v in mine.items())
    assert tuple(mine["layers.0.mlp.experts.down"].shape) == (4, 64, 48)
    save_file({k: v.contiguous() for k, v in logical_to_hf(mine, spec).items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(__import__("json").dumps(hf_config_dict(spec)))
    loaded = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, ref)
    # a Mixtral directory (what save_pretrained writes) imports as a megazero checkpoint of the same tensors
    from safetensors.torch import load_file

    from megazero.checkpoint.convert import consolidate, import_hf
    ckpt = import_hf(str(tmp_path), hf.config, str(tmp_path / "ckpt"))
    consolidate(ckpt, str(tmp_path / "whole.safetensors"))
    whole = load_file(str(tmp_path / "whole.safetensors"))
    assert whole.keys() == mine.keys() and all(torch.equal(whole[k], v) for k, v in mine.items())


def test_mixtral_at_tp2_and_what_mixtral_cannot_hold():
    hf = make_mixtral()
    spec = spec_from_hf_config(hf.config)
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    logits, exported = run_ranks(_tp2_worker, 2, spec, state, timeout=60)[0]
    with torch.no_grad():
        assert (torch.from_numpy(np.asarray(logits)) - hf(TOKENS).logits).abs().max().item() <= TOL
    mine = hf_to_logical(hf.state_dict(), spec)
    again = hf_to_logical({k: torch.from_numpy(v) for k, v in exported.items()}, spec)
    assert all(torch.equal(again[k], v) for k, v in mine.items())
    from megazero.models.hf import hf_export_plan
    with pytest.raises(SpecError, match="moe_score='sigmoid' has no Hugging Face Mixtral equivalent"):
        hf_export_plan(spec.replace(moe_score="sigmoid"))
    with pytest.raises(SpecError, match="sliding_window=16 is not supported"):
        spec_from_hf_config(transformers.MixtralConfig(sliding_window=16))
    with pytest.raises(SpecError, match="moe_capacity_factor=1.25 has no Hugging Face Mixtral equivalent"):
        hf_export_plan(spec.replace(moe_capacity_factor=1.25))  # Mixtral never drops a token
    with pytest.raises(SpecError, match="moe_top_k=1 has no Hugging Face Mixtral equivalent"):
        hf_export_plan(spec.replace(moe_top_k=1))  # its one weight would be 1, megazero's the score
    with pytest.raises(SpecError, match="num_experts_per_tok=1 is not supported"):
        spec_from_hf_config(transformers.MixtralConfig(num_experts_per_tok=1))
