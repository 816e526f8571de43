"""`ConfigError` and the closest-key suggestions used by every config error message (`closest` is
`megazero.core.suggest`'s, re-exported here).

Pure Python: no torch, no OmegaConf.
"""
from __future__ import annotations

from typing import Iterable

from ..suggest import closest


class ConfigError(ValueError):
    """A configuration problem found before any process group exists.

    The message always starts with the offending dotted key (``train.micro_batch_size: ...``)
    and says what would be valid.
    """


def unknown_key_error(full_key: str, siblings: Iterable[str], everywhere: Iterable[str] = (),
                      what: str = "key") -> ConfigError:
    """An error for an unknown dotted `full_key` that names the closest valid key.

    Args:
        full_key: the dotted key the user wrote, e.g. ``"train.micro_batch"``.
        siblings: the valid dotted keys at the same level, e.g. ``["train.micro_batch_size", ...]``.
        everywhere: every valid dotted key; used when no sibling is close, so that
            ``micro_batch_size`` at the top level suggests ``train.micro_batch_size``.
        what: the noun in the message (``"key"`` or ``"DeepSpeed key"``).
    """
    siblings = sorted(siblings)
    everywhere = sorted(everywhere)
    leaf = full_key.rsplit(".", 1)[-1]
    by_leaf = {s.rsplit(".", 1)[-1]: s for s in siblings}
    leaf_of_all: dict[str, str] = {}
    for k in everywhere:
        leaf_of_all.setdefault(k.rsplit(".", 1)[-1], k)
    if leaf in leaf_of_all:  # the right key in the wrong section
        suggestion: str | None = leaf_of_all[leaf]
    else:
        guess = closest(leaf, by_leaf)
        suggestion = by_leaf[guess] if guess is not None else None
    if suggestion is None:
        guess = closest(leaf, leaf_of_all) or closest(full_key, everywhere)
        suggestion = leaf_of_all.get(guess, guess) if guess is not None else None
    msg = f"{full_key}: unknown {what}"
    if suggestion is not None:
        msg += f"; did you mean {suggestion!r}?"
    if siblings:
        shown = ", ".join(siblings[:40]) + (", ..." if len(siblings) > 40 else "")
        msg += f" (valid here: {shown})"
    return ConfigError(msg)
