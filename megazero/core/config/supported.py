"""Features the schema can express but megazero does not implement yet.

`NOT_SUPPORTED` lists them as (dotted key, predicate on the value, what it is). The trainer calls
`assert_supported(cfg)` after `resolve`; a key whose predicate is true raises
``ConfigError("<key>: not supported yet ...")`` instead of being silently ignored.

When a feature lands, delete its line here (and add its test). Everything beyond the plain
PP x TP x DP layout in fp32 with Adam starts out listed.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

from .errors import ConfigError
from .schema import Config, get_key


class Unsupported(NamedTuple):
    key: str  # dotted key of the schema
    active: Callable[[Any], bool]  # true for the values that need the missing feature
    what: str  # the feature, for the message


NOT_SUPPORTED: tuple[Unsupported, ...] = (
    Unsupported("zero.contiguous_gradients", lambda v: v is False, "non-contiguous gradients"),
    Unsupported("zero.reduce_scatter", lambda v: v is False, "all-reduce instead of reduce-scatter"),
    Unsupported("zero.allgather_partitions", lambda v: v is False, "broadcast instead of all-gather"),
    Unsupported("zero.round_robin_gradients", lambda v: bool(v), "round-robin gradient partitioning"),
    Unsupported("zero.sub_group_size", lambda v: v != 1_000_000_000, "tiled optimizer steps"),
    Unsupported("zero.max_live_parameters", lambda v: v != 1_000_000_000, "a cap on live ZeRO-3 parameters"),
    Unsupported("zero.max_reuse_distance", lambda v: v != 1_000_000_000, "ZeRO-3 parameter reuse distance"),
    Unsupported("zero.gather_16bit_weights_on_model_save", lambda v: bool(v), "consolidated 16-bit weights"),
    Unsupported("fp16.consecutive_hysteresis", lambda v: bool(v), "consecutive loss-scale hysteresis"),
    Unsupported("data.tokenizer", lambda v: v != "byte", "the BPE tokenizer"),
    Unsupported("train.eval_interval", lambda v: v > 0, "evaluation"),
    Unsupported("train.eval_steps", lambda v: v != 1, "evaluation (the batches each evaluation reads)"),
)


def unsupported(cfg: Config, table: tuple[Unsupported, ...] = NOT_SUPPORTED) -> list[str]:
    """One ``"<key>: not supported yet (<what>; got <value>)"`` line per active entry of `table`."""
    lines = []
    for entry in table:
        value = get_key(cfg, entry.key)
        if entry.active(value):
            lines.append(f"{entry.key}: not supported yet ({entry.what}; got {value!r}); "
                         f"leave it at its default")
    return lines


def assert_supported(cfg: Config, table: tuple[Unsupported, ...] = NOT_SUPPORTED) -> None:
    """Raise ConfigError listing every key of `cfg` that needs a feature in `table`."""
    lines = unsupported(cfg, table)
    if lines:
        raise ConfigError("\n".join(lines))
