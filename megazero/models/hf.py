"""Conversion between Hugging Face `transformers` checkpoints and megazero's logical parameters.

Supports GPT2LMHeadModel (model_type ``gpt2``), LlamaForCausalLM (``llama``) and MixtralForCausalLM
(``mixtral``: a Llama whose every MLP is a softmax top-k Mixture of Experts). Works on plain state
dicts and config objects, so megazero does not import `transformers`:

    spec = spec_from_hf_config(hf_model.config)
    model = CausalLM(spec, tp_group)                       # any TP size
    load_hf_state_dict(model, hf_model.state_dict(), spec)  # each rank copies its shards
    hf_state = export_hf_state_dict(model, spec, tp_group)  # all-gathers over the TP group

For converting files tensor by tensor (`megazero.checkpoint.convert`), `hf_export_plan` and
`hf_import_plan` give, for each output tensor, the input tensors it is made of and how;
`hf_config_dict` writes the ``config.json`` of a spec.

GPT-2 stores linear weights as Conv1D (in, out) and fuses q, k, v in ``c_attn`` (columns [q | k | v]);
megazero keeps (out, in) and separate q, k, v, so import transposes and splits and export does the
inverse; both are exact (no arithmetic). Llama's q_proj/k_proj/v_proj/o_proj and gate/up/down_proj
map one to one. Mixtral's router ``block_sparse_moe.gate`` is megazero's ``mlp.router`` (E, h), and expert
e's ``w1`` / ``w3`` / ``w2`` are row e of megazero's stacked ``mlp.experts.gate`` / ``up`` (E, f, h) and
``down`` (E, h, f). Export writes those per-expert names (the layout of the published checkpoints, which
every transformers version loads); import also takes transformers 5's in-memory layout
(``mlp.experts.gate_up_proj`` (E, 2f, h) = [gate | up] and ``mlp.experts.down_proj``).
"""
from __future__ import annotations

from collections.abc import Callable

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
    elif kind in ("llama", "mixtral"):
        rope = getattr(config, "rope_parameters", None) or {"rope_type": "default",
                                                            "rope_theta": getattr(config, "rope_theta", 1e4)}
        if rope.get("rope_type", "default") != "default":
            raise SpecError(f"Llama rope_type={rope.get('rope_type')!r} is not supported; only 'default'")
        if config.hidden_act != "silu":
            raise SpecError(f"Llama hidden_act={config.hidden_act!r} is not supported; only 'silu'")
        if kind == "llama" and config.attention_bias != config.mlp_bias:
            raise SpecError("Llama attention_bias and mlp_bias must be equal (megazero has one `bias` field)")
        head_dim = getattr(config, "head_dim", None)
        if head_dim is not None and head_dim * config.num_attention_heads != config.hidden_size:
            raise SpecError(f"Llama head_dim={head_dim} must equal hidden_size / num_attention_heads")
        spec = ModelSpec(family="llama", layers=config.num_hidden_layers, hidden=config.hidden_size,
                         heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                         ffn_hidden=config.intermediate_size, vocab=config.vocab_size,
                         seq_len=config.max_position_embeddings, norm="rmsnorm", activation="swiglu",
                         position="rope", tie_embeddings=bool(config.tie_word_embeddings),
                         bias=bool(getattr(config, "attention_bias", False)), attention_dropout=float(config.attention_dropout),
                         eps=config.rms_norm_eps, rope_theta=float(rope["rope_theta"]), scaled_init=False,
                         init_std=config.initializer_range, name="hf:llama", **_mixtral_moe(config))
    else:
        raise SpecError(f"Hugging Face model_type={kind!r} is not supported; valid: gpt2, llama, mixtral")
    return spec.replace(**overrides) if overrides else spec


def _mixtral_moe(config) -> dict:
    """The MoE fields of a MixtralConfig (none for a LlamaConfig); SpecError names what megazero lacks."""
    if getattr(config, "model_type", None) != "mixtral":
        return {}
    if getattr(config, "router_jitter_noise", 0.0):
        raise SpecError(f"Mixtral router_jitter_noise={config.router_jitter_noise} is not supported; only 0.0")
    if config.num_experts_per_tok < 2:
        raise SpecError(f"Mixtral num_experts_per_tok={config.num_experts_per_tok} is not supported; valid: 2 or "
                        f"more (Mixtral's one weight is always 1, megazero's is the router's score)")
    if getattr(config, "sliding_window", None) is not None:
        raise SpecError(f"Mixtral sliding_window={config.sliding_window} is not supported; only None (full attention)")
    # Mixtral drops no tokens and has no router z-loss; its aux loss coefficient is router_aux_loss_coef
    return {"moe_num_experts": config.num_local_experts, "moe_top_k": config.num_experts_per_tok,
            "moe_ffn": config.intermediate_size, "moe_score": "softmax", "moe_normalize_topk": True,
            "moe_capacity_factor": None, "moe_aux_loss_coef": float(config.router_aux_loss_coef),
            "moe_z_loss_coef": 0.0}


def hf_config_dict(spec: ModelSpec) -> dict:
    """The ``config.json`` of the Hugging Face model equal to `spec` (the inverse of
    `spec_from_hf_config`); SpecError names the field that model cannot represent."""
    def need(field, ok, valid):
        if not ok:
            raise SpecError(f"{field}={getattr(spec, field)!r} has no Hugging Face {kind} equivalent; valid: {valid}")

    if spec.family == "gpt":
        kind, acts = "GPT-2", {v: k for k, v in reversed(list(_GPT2_ACT.items()))}
        need("activation", spec.activation in acts, ", ".join(acts))
        need("norm", spec.norm == "layernorm", "layernorm")
        need("position", spec.position == "learned", "learned")
        need("tie_embeddings", spec.tie_embeddings, "True")
        need("bias", spec.bias, "True")
        need("kv_heads", spec.num_kv_heads == spec.heads, f"None or {spec.heads}")
        need("embedding_norm", not spec.embedding_norm, "False")
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": spec.layers,
                "n_embd": spec.hidden, "n_head": spec.heads, "n_inner": spec.ffn, "vocab_size": spec.vocab,
                "n_positions": spec.seq_len, "activation_function": acts[spec.activation],
                "layer_norm_epsilon": spec.eps, "resid_pdrop": spec.dropout, "embd_pdrop": spec.dropout,
                "attn_pdrop": spec.attention_dropout, "initializer_range": spec.init_std,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False, "tie_word_embeddings": True}
    kind = "Llama" if spec.moe is None else "Mixtral"
    need("norm", spec.norm == "rmsnorm", "rmsnorm")
    need("activation", spec.activation == "swiglu", "swiglu")
    need("position", spec.position == "rope", "rope")
    need("dropout", spec.dropout == 0.0, "0.0")
    need("embedding_norm", not spec.embedding_norm, "False")
    if spec.moe is not None:
        return _mixtral_config(spec, need)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": spec.hidden,
            "intermediate_size": spec.ffn, "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "vocab_size": spec.vocab,
            "max_position_embeddings": spec.seq_len, "rms_norm_eps": spec.eps, "hidden_act": "silu",
            "rope_theta": spec.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
            "attention_bias": spec.bias, "mlp_bias": spec.bias, "tie_word_embeddings": spec.tie_embeddings,
            "attention_dropout": spec.attention_dropout, "initializer_range": spec.init_std}


def _mixtral_config(spec: ModelSpec, need) -> dict:
    """MixtralForCausalLM's config.json of an MoE spec (checked by `hf_config_dict`'s `need`)."""
    moe = spec.moe
    need("moe_score", moe.score == "softmax", "softmax")
    need("moe_normalize_topk", moe.normalize_topk, "True")
    # Mixtral renormalises the k weights even at k = 1 (weight 1); megazero weights by the score there (Switch)
    need("moe_top_k", moe.top_k > 1, "2 or more")
    # Mixtral never drops a token; megazero's capacity drops at evaluation too
    need("moe_capacity_factor", moe.capacity_factor is None, "None")
    need("moe_shared_experts", moe.shared_experts == 0, "0")
    need("bias", not spec.bias, "False")
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": spec.hidden,
            "intermediate_size": moe.ffn, "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "vocab_size": spec.vocab,
            "max_position_embeddings": spec.seq_len, "rms_norm_eps": spec.eps, "hidden_act": "silu",
            "rope_theta": spec.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
            "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "router_aux_loss_coef": moe.aux_loss_coef, "router_jitter_noise": 0.0, "sliding_window": None,
            "tie_word_embeddings": spec.tie_embeddings, "attention_dropout": spec.attention_dropout,
            "initializer_range": spec.init_std}


# A plan maps each output tensor to (the input tensors it needs, how it is made from them), so that a
# converter can produce one tensor at a time (bounded memory) and shapes can be found on "meta".
Plan = dict[str, tuple[list[str], Callable[..., torch.Tensor]]]
_SAME = lambda t: t  # noqa: E731
_T = lambda t: t.t()  # noqa: E731  (out, in) <-> GPT-2 Conv1D (in, out)


def _cols(j: int, h: int, transpose: bool):
    """Columns [j·h, (j+1)·h) of GPT-2's fused c_attn ([q | k | v]); transposed for the weight."""
    return (lambda t: t[:, j * h:(j + 1) * h].t()) if transpose else (lambda t: t[j * h:(j + 1) * h])


def _qkv_cat(dim: int, transpose: bool):
    return lambda q, k, v: torch.cat([x.t() if transpose else x for x in (q, k, v)], dim=dim)


_GPT2_LAYER = {"attn_norm": "ln_1", "mlp_norm": "ln_2"}
_GPT2_LINEAR = {"attn.out": "attn.c_proj", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
_LLAMA_LAYER = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
                "attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj",
                "attn.out": "self_attn.o_proj", "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj",
                "mlp.down": "mlp.down_proj"}


_LLAMA_MLP = ("mlp.gate", "mlp.up", "mlp.down")
_MIXTRAL_EXPERT = {"gate": "w1", "down": "w2", "up": "w3"}  # megazero's stacked expert tensor -> Mixtral's name


def _mixtral_experts(spec: ModelSpec) -> list[tuple[str, str, list[str]]]:
    """(megazero router name, Mixtral gate key, []) and (megazero stacked expert tensor, "", [Mixtral key of
    expert 0, 1, ...]) of every layer."""
    rows = []
    for i in range(spec.layers):
        moe = f"model.layers.{i}.block_sparse_moe."
        rows.append((f"layers.{i}.mlp.router", moe + "gate.weight", []))
        for ours, theirs in _MIXTRAL_EXPERT.items():
            rows.append((f"layers.{i}.mlp.experts.{ours}", "",
                         [f"{moe}experts.{e}.{theirs}.weight" for e in range(spec.moe.num_experts)]))
    return rows


def _row(e: int):
    return lambda t: t[e]


def _stack(*rows):
    return torch.stack(rows)


def _from_fused_experts(hf_state: dict, spec: ModelSpec) -> dict:
    """transformers 5's in-memory Mixtral layout (``mlp.gate``, ``mlp.experts.gate_up_proj`` (E, 2f, h) =
    [gate | up], ``mlp.experts.down_proj`` (E, h, f)) renamed and split into the published per-expert keys;
    other state dicts are returned as they are. Views only (no copies)."""
    if spec.moe is None or not any(k.endswith("mlp.experts.gate_up_proj") for k in hf_state):
        return hf_state
    out = dict(hf_state)
    f = spec.moe.ffn
    for i in range(spec.layers):
        p, moe = f"model.layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe."
        out[moe + "gate.weight"] = out.pop(p + "gate.weight")
        gate_up, down = out.pop(p + "experts.gate_up_proj"), out.pop(p + "experts.down_proj")
        for e in range(spec.moe.num_experts):
            out[f"{moe}experts.{e}.w1.weight"] = gate_up[e, :f]  # (f, h)
            out[f"{moe}experts.{e}.w3.weight"] = gate_up[e, f:]  # (f, h)
            out[f"{moe}experts.{e}.w2.weight"] = down[e]  # (h, f)
    return out


def _llama_names(spec: ModelSpec) -> dict[str, str]:
    """{megazero logical name: HF key} for a Llama spec."""
    names = {"embedding.word.weight": "model.embed_tokens.weight", "head.norm.weight": "model.norm.weight"}
    if not spec.tie_embeddings:
        names["head.weight"] = "lm_head.weight"
    for i in range(spec.layers):
        for ours, theirs in _LLAMA_LAYER.items():
            if spec.moe is not None and ours in _LLAMA_MLP:
                continue  # Mixtral: the MoE tensors (`_mixtral_experts`)
            suffixes = [""] if ours.endswith(".weight") else [".weight"] + ([".bias"] if spec.bias else [])
            for suf in suffixes:
                names[f"layers.{i}.{ours}{suf}"] = f"model.layers.{i}.{theirs}{suf}"
    return names


def _gpt2_pairs(spec: ModelSpec) -> list[tuple[str, str, bool]]:
    """(megazero logical name, HF key, transposed) of the GPT-2 tensors that map one to one."""
    pairs = [("embedding.word.weight", "transformer.wte.weight", False),
             ("embedding.position.weight", "transformer.wpe.weight", False),
             ("head.norm.weight", "transformer.ln_f.weight", False), ("head.norm.bias", "transformer.ln_f.bias", False)]
    for i in range(spec.layers):
        p, q = f"transformer.h.{i}.", f"layers.{i}."
        for ours, theirs in {**_GPT2_LAYER, **_GPT2_LINEAR}.items():
            pairs += [(q + ours + ".weight", p + theirs + ".weight", ours in _GPT2_LINEAR),
                      (q + ours + ".bias", p + theirs + ".bias", False)]
    return pairs


def _check_mappable(spec: ModelSpec) -> None:
    """GPT-2 and Llama have no embedding norm (BLOOM's word_embeddings_layernorm is not mapped)."""
    if spec.embedding_norm:
        raise SpecError("embedding_norm=True has no Hugging Face GPT-2 or Llama equivalent; valid: False")


def hf_export_plan(spec: ModelSpec) -> Plan:
    """{HF key: ([megazero logical names], make)} of the whole HF state dict (tied lm_head included)."""
    _check_mappable(spec)
    if spec.family == "llama":
        plan = {theirs: ([ours], _SAME) for ours, theirs in _llama_names(spec).items()}
        if spec.tie_embeddings:
            plan["lm_head.weight"] = (["embedding.word.weight"], _SAME)
        if spec.moe is not None:
            hf_config_dict(spec)  # SpecError naming what Mixtral cannot represent
            for ours, theirs, per_expert in _mixtral_experts(spec):
                plan.update({theirs: ([ours], _SAME)} if theirs else
                            {key: ([ours], _row(e)) for e, key in enumerate(per_expert)})
        return plan
    plan = {theirs: ([ours], _T if transposed else _SAME) for ours, theirs, transposed in _gpt2_pairs(spec)}
    plan["lm_head.weight"] = (["embedding.word.weight"], _SAME)
    for i in range(spec.layers):
        p, q = f"transformer.h.{i}.attn.c_attn.", f"layers.{i}.attn."
        plan[p + "weight"] = ([q + n + ".weight" for n in "qkv"], _qkv_cat(1, True))  # (h, 3h)
        plan[p + "bias"] = ([q + n + ".bias" for n in "qkv"], _qkv_cat(0, False))  # (3h,)
    return plan


def hf_import_plan(spec: ModelSpec) -> Plan:
    """{megazero logical name: ([HF keys], make)}: the inverse of `hf_export_plan`."""
    _check_mappable(spec)
    if spec.family == "llama":
        plan = {ours: ([theirs], _SAME) for ours, theirs in _llama_names(spec).items()}
        if spec.moe is not None:
            hf_config_dict(spec)
            for ours, theirs, per_expert in _mixtral_experts(spec):
                plan[ours] = ([theirs], _SAME) if theirs else (per_expert, _stack)
        return plan
    plan = {ours: ([theirs], _T if transposed else _SAME) for ours, theirs, transposed in _gpt2_pairs(spec)}
    h = spec.hidden
    for i in range(spec.layers):
        p, q = f"transformer.h.{i}.attn.c_attn.", f"layers.{i}.attn."
        for j, n in enumerate("qkv"):
            plan[q + n + ".weight"] = ([p + "weight"], _cols(j, h, True))
            plan[q + n + ".bias"] = ([p + "bias"], _cols(j, h, False))
    return plan


def run_plan(plan: Plan, get: Callable[[str], torch.Tensor]):
    """Yield (output name, tensor) of `plan`, one at a time, reading inputs through `get` (which
    raises naming a missing input)."""
    for name, (inputs, make) in plan.items():
        yield name, make(*[get(k) for k in inputs]).contiguous()


def _getter(state: dict, what: str):
    def get(key):
        if key not in state:
            raise KeyError(f"the {what} has no {key!r} (its keys start with {sorted(state)[:3]})")
        return state[key]
    return get


def hf_to_logical(hf_state: dict, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Convert a Hugging Face state dict to {megazero logical name: full tensor}."""
    if spec.family == "gpt" and "wte.weight" in hf_state:  # a GPT2Model's keys, without "transformer."
        hf_state = {f"transformer.{k}": v for k, v in hf_state.items()}
    get = _getter(_from_fused_experts(hf_state, spec), "Hugging Face state dict")
    return {k: v.detach().clone() for k, v in run_plan(hf_import_plan(spec), get)}


def logical_to_hf(full: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Convert {megazero logical name: full tensor} to a Hugging Face state dict (the inverse)."""
    get = _getter(full, "megazero state")
    return {k: v.detach().clone() for k, v in run_plan(hf_export_plan(spec), get)}


def load_hf_state_dict(model_or_layers, hf_state: dict, spec: ModelSpec) -> None:
    """Copy this rank's shards of a Hugging Face state dict into a megazero model (or the layers of one
    pipeline stage). No communication; every parameter the layers hold must be present."""
    load_full_params(model_or_layers, hf_to_logical(hf_state, spec), strict=True)


def export_hf_state_dict(model_or_layers, spec: ModelSpec, tp_group: GroupHandle) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict of a whole (pp=1) megazero model; all-gathers split parameters over
    `tp_group` (every TP rank must call it and gets the full result)."""
    return logical_to_hf(gather_full_params(model_or_layers, tp_group), spec)
