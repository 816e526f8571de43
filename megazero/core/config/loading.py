"""`load_config`: YAML, megazero JSON or DeepSpeed JSON, plus ``key=value`` overrides.

Layers, lowest first: schema defaults, ``name`` = the file's stem, the file, the overrides. Every
layer is checked against the schema (`tree.check_tree`) before OmegaConf merges them, so unknown
keys and wrong types fail with the key named, whichever layer they came from.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .deepspeed import defaults_applied, is_deepspeed, translate
from .errors import ConfigError
from .schema import Config
from .tree import build_config, check_tree
from .validate import resolve, validate

YAML_SUFFIXES = (".yaml", ".yml")


def _read_json(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level, got {type(data).__name__}")
    return read_tree(data)


def read_tree(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """A config given as data (a dict in megazero's schema, or DeepSpeed's: told apart by its keys)
    as a checked megazero-shaped dict and its DeepSpeed labels (see `read_file`). Values are taken
    as they are, never re-parsed from strings."""
    if is_deepspeed(data):
        tree, labels = translate(data)
        return check_tree(tree, labels=labels), labels
    return check_tree(data), {}


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        loaded = OmegaConf.load(path)
        data = OmegaConf.to_container(loaded, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {e}") from e
    except Exception as e:  # yaml.YAMLError and friends: report the file, keep the parser's position
        raise ConfigError(f"{path}: invalid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys at the top level, got {type(data).__name__}")
    return check_tree(data)


def read_file(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """One config file as a checked megazero-shaped dict (DeepSpeed JSON is translated).

    Returns:
        (tree, labels): labels maps megazero dotted keys to the DeepSpeed keys they came from
        (empty for megazero files), so later validation errors can name both.
    """
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such config file")
    if path.endswith(".json"):
        return _read_json(path)
    if path.endswith(YAML_SUFFIXES):
        return _read_yaml(path), {}
    raise ConfigError(f"{path}: unknown config file type; use .yaml, .yml or .json (DeepSpeed or megazero)")


def deepspeed_defaults_of(path: str | None) -> list[str]:
    """For a DeepSpeed JSON file, the lines of `deepspeed.defaults_applied` (else none)."""
    if path is None or not path.endswith(".json"):
        return []
    with open(path) as f:
        data = json.load(f)
    return defaults_applied(data) if isinstance(data, dict) and is_deepspeed(data) else []


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """``["train.steps=10", "model.layers=6"]`` -> a checked nested dict. Values are parsed as YAML."""
    if isinstance(overrides, str):
        raise ConfigError(f"overrides: expected a list of key=value strings, got the string {overrides!r}")
    for item in overrides:
        if not isinstance(item, str) or "=" not in item or item.startswith("="):
            raise ConfigError(f"{item!r}: an override must look like key=value, e.g. train.steps=10")
        if item[0] in "+~":
            raise ConfigError(f"{item!r}: '+'/'~' prefixes are not used here; write key=value (every key exists)")
    if not overrides:  # no OmegaConf round trip for nothing (most loads: every layout a tool checks)
        return check_tree({})
    try:
        data = OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)), resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"overrides {list(overrides)}: {e}") from e
    return check_tree(data)


def load_config(path: str | dict[str, Any] | None = None, overrides: Sequence[str] = (),
                world_size: Optional[int] = None) -> Config:
    """Load, merge and validate a config.

    Args:
        path: a .yaml/.yml file in megazero's schema, a .json file in megazero's schema, or a
            DeepSpeed .json config (told apart by its keys); or the same as a dict (merged as data);
            None for defaults plus overrides.
        overrides: ``key=value`` strings (dotted keys of the schema), applied last.
        world_size: number of ranks. When given (or when parallel.dp is set) the result is
            `resolve`d: dp, the batch triple and every other derived field are filled. Otherwise
            it is validated and returned unresolved.

    Raises:
        ConfigError: the first line names the offending key and says what would be valid.
    """
    layers: list[dict[str, Any]] = []
    labels: dict[str, str] = {}
    if isinstance(path, dict):
        tree, labels = read_tree(path)
        layers.append(tree)
    elif path is not None:
        stem = os.path.splitext(os.path.basename(path))[0]
        if stem:
            layers.append({"name": stem})
        tree, labels = read_file(path)
        layers.append(tree)
    layers.append(parse_overrides(overrides))
    cfg = build_config(layers)
    try:
        if world_size is None and cfg.parallel.dp is None:
            validate(cfg, None)
            return cfg
        return resolve(cfg, world_size)
    except ConfigError as e:
        raise _relabel(e, labels) from None


def _relabel(err: ConfigError, labels: dict[str, str]) -> ConfigError:
    """Add the DeepSpeed key to each message line that starts with a translated megazero key."""
    if not labels:
        return err
    lines = []
    for line in str(err).split("\n"):
        key = line.split(":", 1)[0].split(" ", 1)[0]
        if key in labels and labels[key] != key:
            line = f"{key} (DeepSpeed {labels[key]}){line[len(key):]}"
        lines.append(line)
    return ConfigError("\n".join(lines))
