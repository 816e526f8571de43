"""`closest`: the one "did you mean" of megazero (config keys, choices, spec fields, flavors,
schedules, partition methods). Pure Python."""
from __future__ import annotations

import difflib
from typing import Iterable


def closest(word: str, candidates: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The candidate most similar to `word` (difflib ratio >= `cutoff`), or None."""
    matches = difflib.get_close_matches(str(word), list(candidates), n=1, cutoff=cutoff)
    return matches[0] if matches else None


def did_you_mean(word: str, candidates: Iterable[str], cutoff: float = 0.6) -> str:
    """``"; did you mean 'x'?"`` for the closest candidate, or ``""``: the tail of an error message."""
    hint = closest(word, candidates, cutoff)
    return f"; did you mean {hint!r}?" if hint is not None else ""
