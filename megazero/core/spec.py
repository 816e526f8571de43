"""ModelSpec: the architecture of a transformer language model, its named flavors, and spec files.

A spec file is a Python file that builds `ModelSpec`s, e.g. ``model_specs/gpt.py``; it defines
``FLAVORS = {"debug": ModelSpec(...), ...}``. `load_spec("model_specs/gpt.py:debug", overrides)` loads
it *by path* (megazero never imports model_specs/), picks the flavor and applies overrides, given as a
dict or as ``key=value`` strings. An unknown field is an error naming the closest valid field.

Validation happens in two steps, both before any compute: `ModelSpec.validate()` checks the
architecture alone (run by the constructor), `validate_layout(tp, sequence_parallel, seq_len)` checks
that it can be split over a TP group. Grouped-query attention splits the KV heads over TP ranks, so
tp must divide kv_heads; replicating KV heads across TP ranks (tp > kv_heads) is not supported.

A spec is pure data (L0): building modules from it is `megazero.models` (`CausalLM(spec, tp_group)`,
`layer_builders(spec, tp_group)`, `count_params(spec)`).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import typing
from dataclasses import dataclass, field

from megazero.core.moe_spec import MoESpec, MoESpecError
from megazero.core.suggest import closest, did_you_mean

FAMILIES = ("gpt", "llama")
NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "swiglu")
POSITIONS = ("learned", "rope", "alibi")


class SpecError(ValueError):
    """An invalid model spec, spec file, override or layout. The message names the field."""


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only transformer LM.

    family: ``gpt`` (LayerNorm, GeLU MLP, learned positions or ALiBi, biases, tied embeddings) or
    ``llama`` (RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases, untied head); the
    individual fields below decide, the family only supplies defaults in the spec files.
    kv_heads None = heads; ffn_hidden None = 4·hidden. embedding_norm: a norm (of kind `norm`,
    logical name ``embedding.norm``) on the embedding output, before the blocks, as BLOOM's
    ``word_embeddings_layernorm``.
    """

    family: str = "gpt"
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: typing.Optional[int] = None
    ffn_hidden: typing.Optional[int] = None
    vocab: int = 1000
    seq_len: int = 32
    norm: str = "layernorm"
    activation: str = "gelu_tanh"
    position: str = "learned"
    tie_embeddings: bool = True
    bias: bool = True
    embedding_norm: bool = False
    dropout: float = 0.0
    attention_dropout: float = 0.0
    eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    scaled_init: bool = True  # output projections use init_std / sqrt(2·layers), as GPT-2
    vocab_align: int = 128  # the padded vocabulary is a multiple of tp·vocab_align
    # Mixture of Experts (megazero.core.moe_spec.MoESpec): moe_num_experts > 0 makes every MLP an MoE
    # layer; the config keys are model.moe.<name without moe_>.
    moe_num_experts: int = 0
    moe_top_k: int = 2
    moe_ffn: typing.Optional[int] = None  # each routed expert's hidden size; None = ffn_hidden
    moe_score: str = "softmax"
    moe_normalize_topk: bool = True
    moe_capacity_factor: typing.Optional[float] = None  # None: no token dropping
    moe_aux_loss_coef: float = 0.01
    moe_z_loss_coef: float = 0.001
    moe_shared_experts: int = 0
    moe_shared_ffn: typing.Optional[int] = None
    name: str = field(default="", compare=False)

    def __post_init__(self):
        self.validate()

    # -- derived -------------------------------------------------------------------------
    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden

    @property
    def moe(self) -> MoESpec | None:
        """The MoE MLP of every block, or None for a dense model."""
        if not self.moe_num_experts:
            return None
        return MoESpec(num_experts=self.moe_num_experts, ffn=self.moe_ffn or self.ffn, top_k=self.moe_top_k,
                       activation=self.activation, score=self.moe_score, normalize_topk=self.moe_normalize_topk,
                       capacity_factor=self.moe_capacity_factor, aux_loss_coef=self.moe_aux_loss_coef,
                       z_loss_coef=self.moe_z_loss_coef, shared_experts=self.moe_shared_experts,
                       shared_ffn=self.moe_shared_ffn)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def padded_vocab(self, tp: int) -> int:
        m = tp * self.vocab_align
        return -(-self.vocab // m) * m

    def replace(self, **overrides) -> "ModelSpec":
        """A copy with `overrides` applied (validated; unknown names suggest the closest field)."""
        return dataclasses.replace(self, **coerce_overrides(overrides))

    # -- validation ----------------------------------------------------------------------
    def validate(self) -> None:
        """Check the architecture on its own; raise SpecError naming the field."""
        _choice("family", self.family, FAMILIES)
        _choice("norm", self.norm, NORMS)
        _choice("activation", self.activation, ACTIVATIONS)
        _choice("position", self.position, POSITIONS)
        for f in ("layers", "hidden", "heads", "vocab", "seq_len", "vocab_align"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"{f}={v!r} must be a positive integer")
        for f in ("kv_heads", "ffn_hidden"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise SpecError(f"{f}={v!r} must be a positive integer or None")
        if self.hidden % self.heads:
            raise SpecError(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.heads % self.num_kv_heads:
            raise SpecError(f"heads={self.heads} is not divisible by kv_heads={self.num_kv_heads}")
        if self.position == "rope" and self.head_dim % 2:
            raise SpecError(f"position='rope' needs an even head dim, got hidden/heads={self.head_dim}")
        for f in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, f) < 1.0:
                raise SpecError(f"{f}={getattr(self, f)} must be in [0, 1)")
        if self.eps <= 0 or self.init_std <= 0 or self.rope_theta <= 0:
            raise SpecError("eps, init_std and rope_theta must be positive")
        if self.moe_num_experts < 0:
            raise SpecError(f"moe_num_experts={self.moe_num_experts} must be >= 0 (0: a dense MLP)")
        if self.moe is not None:
            try:
                self.moe.check(1)
            except MoESpecError as err:
                raise SpecError(str(err).replace("model.moe.", "moe_")) from None

    def validate_layout(self, tp: int, sequence_parallel: bool = False, seq_len: int | None = None) -> None:
        """Check that this model splits over a TP group of `tp` ranks; raise SpecError before any compute."""
        if tp < 1:
            raise SpecError(f"tp={tp} must be >= 1")
        if self.hidden % tp:
            raise SpecError(f"hidden={self.hidden} is not divisible by tp={tp}")
        if self.heads % tp:
            raise SpecError(f"heads={self.heads} is not divisible by tp={tp}")
        if self.num_kv_heads < tp:
            raise SpecError(f"tp={tp} > kv_heads={self.num_kv_heads}: replicating KV heads across TP ranks "
                            f"is not supported; use tp <= kv_heads (a divisor of {self.num_kv_heads})")
        if self.num_kv_heads % tp:
            raise SpecError(f"kv_heads={self.num_kv_heads} is not divisible by tp={tp}")
        if self.ffn % tp:
            raise SpecError(f"ffn_hidden={self.ffn} is not divisible by tp={tp}")
        s = seq_len if seq_len is not None else self.seq_len
        if sequence_parallel and tp > 1 and self.moe is not None:
            raise SpecError("sequence_parallel is not supported with Mixture-of-Experts layers yet (the router counts "
                            "capacity and losses per whole sequence)")
        if sequence_parallel and s % tp:
            raise SpecError(f"sequence_parallel needs seq_len={s} divisible by tp={tp}")


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        raise SpecError(f"{name}={value!r} is not one of {', '.join(choices)}{did_you_mean(value, choices)}")


FIELDS = {f.name: f for f in dataclasses.fields(ModelSpec)}


def _parse_value(name: str, raw):
    """Convert a ``key=value`` string to the field's type (ints, floats, bools, None, strings)."""
    if not isinstance(raw, str):
        return raw
    hint = str(FIELDS[name].type)
    low = raw.strip().lower()
    if low in ("none", "null") and "Optional" in hint:
        return None
    try:
        if "bool" in hint:
            if low in ("true", "1", "yes"):
                return True
            if low in ("false", "0", "no"):
                return False
            raise ValueError
        if "int" in hint:
            return int(raw)
        if "float" in hint:
            return float(raw)
    except ValueError:
        raise SpecError(f"{name}={raw!r}: expected a value of type {hint}") from None
    return raw


def coerce_overrides(overrides) -> dict:
    """Overrides as a dict with typed values; accepts a dict or ``["key=value", ...]``."""
    if overrides is None:
        return {}
    if not isinstance(overrides, dict):
        pairs = {}
        for item in overrides:
            if "=" not in item:
                raise SpecError(f"override {item!r} is not of the form key=value")
            k, v = item.split("=", 1)
            pairs[k.strip()] = v
        overrides = pairs
    out = {}
    for k, v in overrides.items():
        if k not in FIELDS or k == "name":
            valid = [f for f in FIELDS if f != "name"]
            hint = closest(k, valid)
            extra = f"; did you mean {hint!r}?" if hint else f"; valid fields: {', '.join(valid)}"
            raise SpecError(f"unknown model spec field {k!r}{extra}")
        out[k] = _parse_value(k, v)
    return out


def _load_module(where: str):
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = os.path.abspath(where)
        if not os.path.isfile(path):
            raise SpecError(f"spec file {where!r} does not exist (resolved to {path})")
        mod_name = "megazero_spec_" + os.path.splitext(os.path.basename(path))[0]
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(where)
    except ImportError as exc:
        raise SpecError(f"cannot import spec module {where!r}: {exc}") from None


def load_spec(ref: str, overrides=None) -> ModelSpec:
    """Load ``"path/to/file.py:flavor"`` (or ``"package.module:flavor"``) and apply `overrides`.

    The file must define ``FLAVORS``, a dict of flavor name -> ModelSpec. Without ``:flavor`` the file
    must define exactly one flavor.
    """
    where, _, flavor = ref.rpartition(":") if ":" in ref else (ref, "", "")
    module = _load_module(where)
    flavors = getattr(module, "FLAVORS", None)
    if not isinstance(flavors, dict) or not flavors:
        raise SpecError(f"spec file {where!r} must define FLAVORS, a dict of name -> ModelSpec")
    if not flavor:
        if len(flavors) != 1:
            raise SpecError(f"{ref!r} names no flavor; choose one of {', '.join(flavors)}")
        flavor = next(iter(flavors))
    if flavor not in flavors:
        raise SpecError(f"flavor {flavor!r} is not in {where!r} (flavors: {', '.join(flavors)})"
                        f"{did_you_mean(flavor, flavors)}")
    spec = flavors[flavor]
    if not isinstance(spec, ModelSpec):
        raise SpecError(f"{where}:{flavor} is a {type(spec).__name__}, not a ModelSpec")
    spec = dataclasses.replace(spec, name=f"{os.path.basename(where)}:{flavor}")
    return spec.replace(**coerce_overrides(overrides)) if overrides else spec


def spec_of(cfg) -> ModelSpec:
    """The ModelSpec a config names: ``model.spec`` with the config's architecture overrides (its typed
    ``model.*`` keys, ``model.moe``, ``model.overrides``) and ``model.seq_len``. The engine builds from it,
    the planner predicts from it, config validation checks it."""
    overrides = cfg.model.architecture()
    if cfg.model.seq_len is not None:
        overrides["seq_len"] = cfg.model.seq_len
    return load_spec(cfg.model.spec, overrides)
