"""Raw nested dicts <-> schema dataclasses.

`check_tree` walks a raw mapping (parsed YAML, dotlist, JSON or translated DeepSpeed JSON) against
the schema before they are merged: every key must exist (else the error names the closest valid
key) and every value must have the field's type (else the error names the key and the expected
type). It returns a normalised copy (integral floats such as ``5e8`` become ints for int fields).
`build_config` merges checked layers over the schema defaults and returns a `Config` dataclass.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping  # not typing.Mapping: isinstance against typing's alias is ~10x slower
from typing import Any

from omegaconf import OmegaConf

from .errors import ConfigError, unknown_key_error
from .schema import Config, all_keys, field_types

_TYPE_WORDS = types.MappingProxyType({int: "an integer", float: "a number", bool: "true or false",
                                      str: "a string"})


def describe_type(tp: Any) -> str:
    """A short human phrase for a schema annotation (``Optional[int]`` -> ``an integer or null``)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "any value"
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return " or ".join(describe_type(a) for a in inner) + " or null"
    if origin in (list, tuple):
        return f"a list of {describe_type(args[0]).split(' ', 1)[-1]}s" if args else "a list"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return f"a mapping (section {tp.__name__})"
    return _TYPE_WORDS.get(tp, getattr(tp, "__name__", str(tp)))


def _shown(value: Any) -> str:
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list",
            dict: "mapping", type(None): "null"}.get(type(value), type(value).__name__)
    return f"{kind} {value!r}"


def _check_value(value: Any, tp: Any, key: str, label: str) -> Any:
    """Check one value against annotation `tp`; return it normalised. `label` names it in errors."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin is typing.Union:
        if value is None:
            return None
        (tp,) = [a for a in args if a is not type(None)]
        return _check_value(value, tp, key, label)
    def bad() -> ConfigError:  # built only when raised: the phrases cost more than the checks
        return ConfigError(f"{label}: expected {describe_type(tp)}, got {_shown(value)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise bad()
        return check_tree(value, tp, key + ".")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad()
        return [_check_value(v, args[0], key, f"{label}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise bad()
        return {k: v for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise bad()
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad()
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            hint = " (quote it)" if isinstance(value, (int, float)) and not isinstance(value, bool) else ""
            raise ConfigError(f"{label}: expected a string, got {_shown(value)}{hint}")
        return value
    raise TypeError(f"schema annotation {tp!r} of {key} is not handled by check_tree")


def check_tree(raw: Any, cls: type = Config, prefix: str = "",
               labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Check raw mapping `raw` against dataclass `cls`; return a normalised plain-dict copy.

    Args:
        raw: the parsed mapping (nested dicts/lists/scalars).
        cls: the schema dataclass for this level.
        prefix: the dotted key of this level (``"zero."``), used in error messages.
        labels: optional dotted-key -> display-name map for messages (the DeepSpeed translator
            uses it so errors name the DeepSpeed key the user wrote).

    Raises:
        ConfigError: an unknown key (naming the closest valid key) or a value of the wrong type.
    """
    labels = labels or {}
    if not isinstance(raw, Mapping):
        where = prefix.rstrip(".") or "config"
        raise ConfigError(f"{labels.get(where, where)}: expected a mapping of keys, got {_shown(raw)}")
    types = field_types(cls)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if not isinstance(key, str) or key not in types:
            raise unknown_key_error(labels.get(full, str(full)), [prefix + k for k in types],
                                    all_keys())
        label = labels.get(full, full)
        tp = types[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{label}: expected a mapping (section {tp.__name__}), got {_shown(value)}")
            out[key] = check_tree(value, tp, full + ".", labels)
        else:
            out[key] = _check_value(value, tp, full, label)
    return out


def build_config(layers: list[Mapping[str, Any]]) -> Config:
    """Merge checked layers (later wins) over the schema defaults; return a `Config` dataclass.

    Each layer must already have passed `check_tree`, so every key exists and every value has its
    field's type: mappings merge key by key, lists and scalars are replaced, and the nested
    dataclasses are built directly (OmegaConf's structured merge did the same at ~150 ms a call,
    which every rank and every layout the tools check paid).
    """
    merged: dict[str, Any] = {}
    for layer in layers:
        _merge_into(merged, layer)
    return _build(Config, merged)


def _merge_into(into: dict[str, Any], layer: Mapping[str, Any]) -> None:
    for key, value in layer.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge_into(into[key], value)
        else:
            into[key] = _copy(value)


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copy(v) for v in value]
    return value


def _build(cls: type, values: Mapping[str, Any]) -> Any:
    """Dataclass `cls` from checked `values`; sections not given keep their defaults."""
    kwargs = {}
    for name, tp in field_types(cls).items():
        if name not in values:
            continue
        value = values[name]
        kwargs[name] = _build(tp, value) if dataclasses.is_dataclass(tp) else value
    return cls(**kwargs)


def to_dict(cfg: Config) -> dict[str, Any]:
    """A plain nested dict of `cfg` (for metadata files and checkpoints)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    """`cfg` as YAML text in megazero's own schema shape (loadable by `load_config`)."""
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)))
