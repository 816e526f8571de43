"""Conversion between Hugging Face `transformers` checkpoints and megazero's logical parameters.

Supports GPT2LMHeadModel (model_type ``gpt2``) and LlamaForCausalLM (``llama``). Works on plain state
dicts and config objects, so megazero does not import `transformers`:

    spec = spec_from_hf_config(hf_model.config)
    model = CausalLM(spec, tp_group)                       # any TP size
    load_hf_state_dict(model, hf_model.state_dict(), spec)  # each rank copies its shards
    hf_state = export_hf_state_dict(model, spec, tp_group)  # all-gathers over the TP group

GPT-2 stores linear weights as Conv1D (in, out) and fuses q, k, v in ``c_attn`` (columns [q | k | v]);
megazero keeps (out, in) and separate q, k, v, so import transposes and splits and export does the
inverse; both are exact (no arithmetic). Llama's q_proj/k_proj/v_proj/o_proj and gate/up/down_proj
map one to one.
"""
from __future__ import annotations

import torch

from megazero.runtime.comm import GroupHandle
from megazero.core.spec import ModelSpec, SpecError
from megazero.tensor_parallel import gather_full_params, load_full_params

_GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


def spec_from_hf_config(config, **overrides) -> ModelSpec:
    """The ModelSpec of a GPT2Config or LlamaConfig (errors name unsupported options)."""
    kind = getattr(config, "model_type", None)
    if kind == "gpt2":
        act = _GPT2_ACT.get(config.activation_function)
        if act is None:
            raise SpecError(f"GPT-2 activation_function={config.activation_function!r} is not supported; "
                            f"valid: {', '.join(_GPT2_ACT)}")
        if not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx:
            raise SpecError("GPT-2 needs scale_attn_weights=True and scale_attn_by_inverse_layer_idx=False")
        spec = ModelSpec(family="gpt", layers=config.n_layer, hidden=config.n_embd, heads=config.n_head,
                         ffn_hidden=config.n_inner, vocab=config.vocab_size, seq_len=config.n_positions,
                         norm="layernorm", activation=act, position="learned", tie_embeddings=True, bias=True,
                         dropout=config.resid_pdrop, attention_dropout=config.attn_pdrop,
                         eps=config.layer_norm_epsilon, init_std=config.initializer_range, name="hf:gpt2")
    elif kind == "llama":
        rope = getattr(config, "rope_parameters", None) or {"rope_type": "default",
                                                            "rope_theta": getattr(config, "rope_theta", 1e4)}
        if rope.get("rope_type", "default") != "default":
            raise SpecError(f"Llama rope_type={rope.get('rope_type')!r} is not supported; only 'default'")
        if config.hidden_act != "silu":
            raise SpecError(f"Llama hidden_act={config.hidden_act!r} is not supported; only 'silu'")
        if config.attention_bias != config.mlp_bias:
            raise SpecError("Llama attention_bias and mlp_bias must be equal (megazero has one `bias` field)")
        head_dim = getattr(config, "head_dim", None)
        if head_dim is not None and head_dim * config.num_attention_heads != config.hidden_size:
            raise SpecError(f"Llama head_dim={head_dim} must equal hidden_size / num_attention_heads")
        spec = ModelSpec(family="llama", layers=config.num_hidden_layers, hidden=config.hidden_size,
                         heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                         ffn_hidden=config.intermediate_size, vocab=config.vocab_size,
                         seq_len=config.max_position_embeddings, norm="rmsnorm", activation="swiglu",
                         position="rope", tie_embeddings=bool(config.tie_word_embeddings),
                         bias=bool(config.attention_bias), attention_dropout=float(config.attention_dropout),
                         eps=config.rms_norm_eps, rope_theta=float(rope["rope_theta"]), scaled_init=False,
                         init_std=config.initializer_range, name="hf:llama")
    else:
        raise SpecError(f"Hugging Face model_type={kind!r} is not supported; valid: gpt2, llama")
    return spec.replace(**overrides) if overrides else spec


class _HFState(dict):
    """A state dict whose missing keys raise a KeyError that says which checkpoint key is missing."""

    def __missing__(self, key):
        raise KeyError(f"the Hugging Face state dict has no {key!r} (its keys start with "
                       f"{sorted(self)[:3]})")


def _strip(state: dict, prefix: str) -> dict:
    return _HFState({k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()})


def _gpt2_layer_map(i: int, h: int, sd: dict) -> dict:
    p, out = f"h.{i}.", {}
    qkv_w, qkv_b = sd[p + "attn.c_attn.weight"], sd[p + "attn.c_attn.bias"]  # (h, 3h), (3h,)
    for j, n in enumerate("qkv"):
        out[f"layers.{i}.attn.{n}.weight"] = qkv_w[:, j * h:(j + 1) * h].t()
        out[f"layers.{i}.attn.{n}.bias"] = qkv_b[j * h:(j + 1) * h]
    pairs = {"attn_norm": "ln_1", "mlp_norm": "ln_2"}
    for ours, theirs in pairs.items():
        out[f"layers.{i}.{ours}.weight"] = sd[p + theirs + ".weight"]
        out[f"layers.{i}.{ours}.bias"] = sd[p + theirs + ".bias"]
    for ours, theirs in {"attn.out": "attn.c_proj", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}.items():
        out[f"layers.{i}.{ours}.weight"] = sd[p + theirs + ".weight"].t()  # Conv1D (in, out) -> (out, in)
        out[f"layers.{i}.{ours}.bias"] = sd[p + theirs + ".bias"]
    return out


_LLAMA_LAYER = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
                "attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj",
                "attn.out": "self_attn.o_proj", "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj",
                "mlp.down": "mlp.down_proj"}


def _llama_names(spec: ModelSpec) -> dict[str, str]:
    """{megazero logical name: HF key} for a Llama spec."""
    names = {"embedding.word.weight": "model.embed_tokens.weight", "head.norm.weight": "model.norm.weight"}
    if not spec.tie_embeddings:
        names["head.weight"] = "lm_head.weight"
    for i in range(spec.layers):
        for ours, theirs in _LLAMA_LAYER.items():
            suffixes = [""] if ours.endswith(".weight") else [".weight"] + ([".bias"] if spec.bias else [])
            for suf in suffixes:
                names[f"layers.{i}.{ours}{suf}"] = f"model.layers.{i}.{theirs}{suf}"
    return names


def hf_to_logical(hf_state: dict, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Convert a Hugging Face state dict to {megazero logical name: full tensor}."""
    if spec.family == "gpt":
        sd = _strip(hf_state, "transformer.")
        h = spec.hidden
        out = {"embedding.word.weight": sd["wte.weight"], "embedding.position.weight": sd["wpe.weight"],
               "head.norm.weight": sd["ln_f.weight"], "head.norm.bias": sd["ln_f.bias"]}
        for i in range(spec.layers):
            out.update(_gpt2_layer_map(i, h, sd))
    else:
        sd = _HFState(hf_state)
        out = {ours: sd[theirs] for ours, theirs in _llama_names(spec).items()}
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def logical_to_hf(full: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Convert {megazero logical name: full tensor} to a Hugging Face state dict (the inverse)."""
    if spec.family == "llama":
        out = {theirs: full[ours] for ours, theirs in _llama_names(spec).items()}
        if spec.tie_embeddings:
            out["lm_head.weight"] = full["embedding.word.weight"]
        return {k: v.detach().clone().contiguous() for k, v in out.items()}
    out = {"transformer.wte.weight": full["embedding.word.weight"],
           "transformer.wpe.weight": full["embedding.position.weight"],
           "transformer.ln_f.weight": full["head.norm.weight"], "transformer.ln_f.bias": full["head.norm.bias"],
           "lm_head.weight": full["embedding.word.weight"]}
    for i in range(spec.layers):
        p, q = f"transformer.h.{i}.", f"layers.{i}."
        out[p + "attn.c_attn.weight"] = torch.cat([full[q + f"attn.{n}.weight"].t() for n in "qkv"], dim=1)
        out[p + "attn.c_attn.bias"] = torch.cat([full[q + f"attn.{n}.bias"] for n in "qkv"])
        for ours, theirs in {"attn_norm": "ln_1", "mlp_norm": "ln_2"}.items():
            out[p + theirs + ".weight"], out[p + theirs + ".bias"] = full[q + ours + ".weight"], full[q + ours + ".bias"]
        for ours, theirs in {"attn.out": "attn.c_proj", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}.items():
            out[p + theirs + ".weight"] = full[q + ours + ".weight"].t()
            out[p + theirs + ".bias"] = full[q + ours + ".bias"]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def load_hf_state_dict(model_or_layers, hf_state: dict, spec: ModelSpec) -> None:
    """Copy this rank's shards of a Hugging Face state dict into a megazero model (or the layers of one
    pipeline stage). No communication; every parameter the layers hold must be present."""
    load_full_params(model_or_layers, hf_to_logical(hf_state, spec), strict=True)


def export_hf_state_dict(model_or_layers, spec: ModelSpec, tp_group: GroupHandle) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict of a whole (pp=1) megazero model; all-gathers split parameters over
    `tp_group` (every TP rank must call it and gets the full result)."""
    return logical_to_hf(gather_full_params(model_or_layers, tp_group), spec)
