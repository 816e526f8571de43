"""DeepSpeed JSON -> megazero `Config`.

`translate` maps a DeepSpeed config dict onto megazero's schema shape using the key table in
`deepspeed_keys` (its docstring is the user-facing table of what each key becomes and which keys
are accepted as documented no-ops). Unknown keys are errors naming the closest DeepSpeed key;
keys megazero does not implement raise ``not supported yet`` unless set to a value at which they
are truly a no-op. ``"auto"`` is accepted for the batch triple and the ZeRO bucket sizes (derived
by `resolve`); anywhere else it is an error, since only the Hugging Face Trainer fills it in.
"""
from __future__ import annotations

import json
from collections.abc import Mapping  # not typing.Mapping: isinstance against typing's alias is slower
from typing import Any

from .deepspeed_keys import (DICT_SECTIONS, OPTIMIZER_TYPES, OTHER_DS_OPTIMIZERS, OTHER_DS_SCHEDULERS,
                             RULES, SCHEDULER_PARAMS, SCHEDULER_TYPES, SPECIAL, Rule)
from ..suggest import did_you_mean
from .errors import ConfigError, closest, unknown_key_error
from .schema import Config, field_types
from .tree import build_config, check_tree

DS_DEFAULT_WARMUP_MAX_LR = 0.001
DS_DEFAULT_WARMUP_NUM_STEPS = 1000
DS_DEFAULT_WARMUP_TYPE = "log"

DS_DEFAULTS: dict[str, tuple[str, Any]] = {"gradient_clipping": ("gradient_clipping", 1.0)}
"""DeepSpeed keys whose DeepSpeed default differs from megazero's: {DeepSpeed key: (megazero key,
DeepSpeed's default)}. A DeepSpeed config that leaves one unset gets DeepSpeed's value, so that the
same file trains the same in both. (The scheduler's warmup defaults are applied in `_scheduler`; the
WarmupCosineLR and OneCycle keys' megazero defaults are DeepSpeed's.)"""


def defaults_applied(ds: Mapping[str, Any]) -> list[str]:
    """Lines naming each DeepSpeed default `translate` fills in for `ds` (for `config explain`)."""
    flat = _flatten(ds)
    lines = [f"{mz}: {value}  # {key} unset: DeepSpeed's default (megazero's own is "
             f"{_schema_default(mz)})" for key, (mz, value) in DS_DEFAULTS.items() if key not in flat]
    name = flat.get("scheduler.type")
    if name in SCHEDULER_TYPES and name != "OneCycle":
        scheduler_defaults = [("warmup_num_steps", "scheduler.warmup_steps", DS_DEFAULT_WARMUP_NUM_STEPS),
                              ("warmup_type", "scheduler.warmup_type", DS_DEFAULT_WARMUP_TYPE)]
        if name == "WarmupDecayLR":
            scheduler_defaults.append(("warmup_max_lr", "scheduler.warmup_max_lr", DS_DEFAULT_WARMUP_MAX_LR))
        own = {"scheduler.warmup_max_lr": "each parameter group's own lr"}
        lines += [f"{mz}: {value}  # scheduler.params.{key} unset: DeepSpeed's {name} default (megazero's own is "
                  f"{own.get(mz, _schema_default(mz))})" for key, mz, value in scheduler_defaults
                  if "scheduler.params." + key not in flat]
    if flat.get("expert_parallel.enabled") is True and "expert_parallel.expert_tensor_parallel_size" not in flat:
        lines.append("parallel.expert_tp: 1  # expert_parallel.expert_tensor_parallel_size unset: DeepSpeed's "
                     "AutoEP default (megazero's own is the TP size)")
    return lines


def _schema_default(dotted: str):
    import dataclasses

    node = Config()
    for part in dotted.split("."):
        node = getattr(node, part)
    return node if not dataclasses.is_dataclass(node) else None


def _flatten(section: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted DeepSpeed key -> value, descending only into `DICT_SECTIONS`."""
    flat: dict[str, Any] = {}
    for key, value in section.items():
        full = prefix + str(key)
        if full == "zero_optimization" and isinstance(value, bool):
            flat["zero_optimization.stage"] = 1 if value else 0  # deprecated boolean form
        elif full in DICT_SECTIONS:
            if value is None:
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(f"{full}: expected a mapping of DeepSpeed keys, got {value!r}")
            flat.update(_flatten(value, full + "."))
        else:
            flat[full] = value
    return flat


def _rule_for(key: str, rules: Mapping[str, Rule]) -> Rule:
    if key in rules:
        return rules[key]
    parent = key.rsplit(".", 1)[0] + "." if "." in key else ""
    depth = key.count(".")
    siblings = [k for k in list(rules) + list(DICT_SECTIONS)
                if k.startswith(parent) and k.count(".") == depth]
    raise unknown_key_error(key, siblings, rules, what="DeepSpeed key")


def _auto_error(key: str, rule: Rule) -> ConfigError:
    target = rule.target if rule.target not in (None, SPECIAL) else key
    return ConfigError(f"{key}: \"auto\" is filled in by the Hugging Face Trainer, not by DeepSpeed; "
                       f"megazero needs a value here (write it in the file or override {target}=...)")


def _precision(flat: Mapping[str, Any]) -> str:
    """fp32/bf16/fp16 from fp16.enabled and bf16.enabled (alias bfloat16.enabled)."""
    on = {}
    for key in ("fp16.enabled", "bf16.enabled", "bfloat16.enabled"):
        value = flat.get(key, False)
        if value == "auto":
            raise ConfigError(f"{key}: \"auto\" is filled in by the Hugging Face Trainer; set true or false "
                              f"(or override precision=fp32|bf16|fp16)")
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        on[key] = value
    bf16 = on["bf16.enabled"] or on["bfloat16.enabled"]
    if on["fp16.enabled"] and bf16:
        raise ConfigError("fp16.enabled and bf16.enabled are both true; enable at most one "
                          "(megazero: precision=fp16 or precision=bf16)")
    return "fp16" if on["fp16.enabled"] else "bf16" if bf16 else "fp32"


def _optimizer(flat: Mapping[str, Any], out: dict[str, Any]) -> None:
    if "optimizer.type" not in flat:
        if any(k.startswith("optimizer.") for k in flat):
            raise ConfigError("optimizer.type: missing; a DeepSpeed optimizer section needs a type "
                              "(Adam, AdamW, SGD)")
        return
    name = flat["optimizer.type"]
    if not isinstance(name, str):
        raise ConfigError(f"optimizer.type: expected a string such as \"AdamW\", got {name!r}")
    kind = OPTIMIZER_TYPES.get(name.lower())
    if kind is None:
        if name.lower() in OTHER_DS_OPTIMIZERS:
            raise ConfigError(f"optimizer.type={name!r}: not supported yet (valid: Adam, AdamW, SGD, OneBitAdam)")
        hint = did_you_mean(name.lower(), list(OPTIMIZER_TYPES) + list(OTHER_DS_OPTIMIZERS))
        raise ConfigError(f"optimizer.type: unknown optimizer {name!r}{hint} (valid: Adam, AdamW, SGD, OneBitAdam)")
    out["optimizer.type"] = kind
    if kind == "onebit_adam":
        out["optimizer.bias_correction"] = False  # DeepSpeed's OneBitAdam corrects neither moment
    if kind == "adam" and "optimizer.params.adam_w_mode" not in flat:
        out["optimizer.adamw_mode"] = True  # DeepSpeed's "Adam" decouples weight decay by default


_DS_REQUIRED = {"WarmupDecayLR": {"total_num_steps": "the step at which lr reaches warmup_min_lr"},
                "WarmupCosineLR": {"total_num_steps": "the step at which lr reaches cos_min_ratio x lr"},
                "OneCycle": {"cycle_min_lr": "DeepSpeed has no default", "cycle_max_lr": "DeepSpeed has no default"}}
"""The scheduler.params each DeepSpeed scheduler needs (its class's arguments without a default), and why."""


def _scheduler(flat: Mapping[str, Any], out: dict[str, Any], labels: dict[str, str]) -> None:
    valid = ", ".join(SCHEDULER_TYPES)
    if "scheduler.type" not in flat:
        if any(k.startswith("scheduler.params.") for k in flat):
            raise ConfigError(f"scheduler.type: missing; scheduler.params needs a type ({valid})")
        return
    name = flat["scheduler.type"]
    if name not in SCHEDULER_TYPES:
        if name in OTHER_DS_SCHEDULERS:
            raise ConfigError(f"scheduler.type={name!r}: not supported yet (valid: {valid})")
        hint = did_you_mean(str(name), SCHEDULER_TYPES + OTHER_DS_SCHEDULERS)
        raise ConfigError(f"scheduler.type: unknown scheduler {name!r}{hint} (valid: {valid})")
    takes = SCHEDULER_PARAMS[name]
    for key, value in flat.items():
        if not key.startswith("scheduler.params."):
            continue
        if key[len("scheduler.params."):] not in takes:
            raise ConfigError(f"{key}: not a parameter of DeepSpeed's {name} (DeepSpeed fails on it); "
                              f"{name} takes {', '.join(takes)}")
        if isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={json.dumps(value)}: not supported yet (a value per parameter group); "
                              f"give one number for all groups")
    for key in _DS_REQUIRED.get(name, ()):
        if "scheduler.params." + key not in flat:
            raise ConfigError(f"scheduler.params.{key}: required by {name} ({_DS_REQUIRED[name][key]})")
    out["scheduler.type"] = name
    if name != "OneCycle":
        out.setdefault("scheduler.warmup_steps", DS_DEFAULT_WARMUP_NUM_STEPS)
        out.setdefault("scheduler.warmup_type", DS_DEFAULT_WARMUP_TYPE)
    if name == "WarmupDecayLR" and "scheduler.params.warmup_max_lr" not in flat:
        # DeepSpeed's WarmupDecayLR peaks at 0.001 for every group without warmup_max_lr, whatever the
        # optimizer's lr; its WarmupLR peaks at each group's own lr then (megazero's warmup_max_lr None)
        out["scheduler.warmup_max_lr"] = DS_DEFAULT_WARMUP_MAX_LR
        labels["scheduler.warmup_max_lr"] = "scheduler.params.warmup_max_lr"


def _deprecated_offload(flat: Mapping[str, Any], out: dict[str, Any]) -> None:
    """zero_optimization.cpu_offload / cpu_offload_param / cpu_offload_use_pin_memory (booleans), unless the
    new spelling is given: cpu_offload(_param) true offloads (false: no offload, the default);
    cpu_offload_use_pin_memory sets both offload_*.pin_memory to its value (DeepSpeed 0.19.8 reads it
    nowhere, its pin_memory staying true; megazero does what the key says)."""
    for key, sections in (("cpu_offload", ("offload_optimizer",)), ("cpu_offload_param", ("offload_param",)),
                          ("cpu_offload_use_pin_memory", ("offload_optimizer", "offload_param"))):
        full = "zero_optimization." + key
        if full not in flat:
            continue
        value = flat[full]
        if not isinstance(value, bool):
            raise ConfigError(f"{full}: expected true or false, got {value!r}")
        for section in sections:
            if key.endswith("pin_memory"):
                out.setdefault(f"zero.{section}.pin_memory", value)
            elif value:
                out.setdefault(f"zero.{section}.device", "cpu")


def _expert_parallel_enabled(flat: Mapping[str, Any]) -> bool:
    """expert_parallel.enabled (DeepSpeed's AutoEP switch; off when absent)."""
    value = flat.get("expert_parallel.enabled", False)
    if not isinstance(value, bool):
        raise ConfigError(f"expert_parallel.enabled: expected true or false, got {json.dumps(value)}")
    return value


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def translate(ds: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Map DeepSpeed config `ds` to a nested dict in megazero's schema shape.

    Returns:
        (tree, labels): the megazero-shaped dict (only keys the file sets) and, for error
        messages, megazero dotted key -> the DeepSpeed key it came from.

    Raises:
        ConfigError: unknown key (naming the closest), unsupported feature or value, "auto"
            where it cannot be derived, fp16 and bf16 both enabled.
    """
    if not isinstance(ds, Mapping):
        raise ConfigError(f"DeepSpeed config: expected a JSON object, got {type(ds).__name__}")
    rules = {r.ds: r for r in RULES}
    flat = _flatten(ds)
    for key in flat:
        _rule_for(key, rules)
    precision = _precision(flat)
    out: dict[str, Any] = {"precision": precision}
    labels = {"precision": "fp16.enabled / bf16.enabled"}
    expert_parallel = _expert_parallel_enabled(flat)
    for key, value in flat.items():
        rule = rules[key]
        if precision != "fp16" and key.startswith("fp16."):
            continue  # DeepSpeed reads the loss-scaler keys only when fp16.enabled is true
        if key.startswith("expert_parallel.") and (not expert_parallel or rule.target == SPECIAL):
            continue  # DeepSpeed reads AutoEP's keys only when expert_parallel.enabled is true
        if rule.auto and value == "auto" and (rule.target or "").startswith("model.moe."):
            continue  # expert_parallel.top_k / score_func "auto": the model's own
        if rule.target == "model.moe.normalize_topk" and value is None:
            continue  # expert_parallel.route_norm null: the model's own
        if isinstance(value, str) and value == "auto":
            if not rule.auto:
                raise _auto_error(key, rule)
            if rule.target == "parallel.pp":
                continue  # pipeline.stages "auto": the PipelineModule's num_stages (megazero.initialize)
            value = None
        if rule.target is None:
            if not rule.noop(value):
                note = f" ({rule.note})" if rule.note else ""
                raise ConfigError(f"{key}={json.dumps(value)}: not supported yet{note}; remove it")
        elif rule.target != SPECIAL:
            out[rule.target] = value
            labels[rule.target] = key
    for key, (target, value) in DS_DEFAULTS.items():
        if key not in flat:
            out[target] = value
            labels[target] = key
    if isinstance(flat.get("sequence_parallel_size"), int) and flat["sequence_parallel_size"] > 1:
        out["parallel.cp_method"] = "ulysses"  # DeepSpeed's sequence parallelism is Ulysses
        labels["parallel.cp_method"] = "sequence_parallel_size"
    if expert_parallel and "expert_parallel.expert_tensor_parallel_size" not in flat:
        out["parallel.expert_tp"] = 1  # DeepSpeed's AutoEP default (megazero's own: the TP size)
        labels["parallel.expert_tp"] = "expert_parallel.expert_tensor_parallel_size"
    _optimizer(flat, out)
    _scheduler(flat, out, labels)
    _deprecated_offload(flat, out)
    return _nest(out), labels


def from_deepspeed(ds: Mapping[str, Any]) -> Config:
    """A `Config` (unresolved: run `resolve` for dp and the batch triple) from a DeepSpeed dict."""
    tree, labels = translate(ds)
    return build_config([check_tree(tree, labels=labels)])


_SHARED_TOP = ("optimizer", "scheduler", "fp16", "gradient_clipping", "activation_checkpointing",
               "checkpoint", "pipeline")


_DS_TOP = frozenset({r.ds.split(".")[0] for r in RULES} | {s.split(".")[0] for s in DICT_SECTIONS})
"""The top-level keys of DeepSpeed's config that megazero reads (from the key table, once)."""


def is_deepspeed(data: Mapping[str, Any]) -> bool:
    """Whether a parsed JSON object is a DeepSpeed config (True) or megazero-shaped (False).

    Raises ConfigError when it mixes keys only DeepSpeed has with keys only megazero has.
    """
    mz_top = field_types(Config)
    ds_top = _DS_TOP
    ds_only = sorted(k for k in data if k in ds_top and k not in mz_top)
    mz_only = sorted(k for k in data if k in mz_top and k not in _SHARED_TOP)
    if ds_only and mz_only:
        raise ConfigError(f"{mz_only[0]}: this JSON mixes megazero keys ({', '.join(mz_only)}) with DeepSpeed "
                          f"keys ({', '.join(ds_only)}); keep the file DeepSpeed-only and pass megazero keys "
                          f"as overrides (e.g. parallel.pp=2)")
    if ds_only or mz_only:
        return bool(ds_only)
    opt, sched, fp16 = data.get("optimizer"), data.get("scheduler"), data.get("fp16")
    if any(isinstance(s, Mapping) and "params" in s for s in (opt, sched)):
        return True
    if isinstance(fp16, Mapping) and "enabled" in fp16:
        return True
    unknown = [k for k in data if k not in mz_top and k not in ds_top]
    return bool(unknown) and closest(unknown[0], ds_top) is not None and closest(unknown[0], mz_top) is None
