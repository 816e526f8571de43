"""All-pairs covering sets of a constrained product of factors.

A *factor* has a name and a tuple of values, its first value being its default. A *case* gives every
factor one value (a dict, in factor order). A *pair* is two factor values ((name_a, value_a),
(name_b, value_b)) with name_a before name_b in factor order. `allowed(case)` is the caller's
predicate (for megazero: the config validation a user gets); a pair is *allowed* when some allowed
case contains it.

* `find_witnesses(factors, allowed, seed)`: for every pair, one allowed case containing it, or none.
  The search tries the pair over the defaults, then every case one value away from that, then every
  witness already found that holds one of the pair's values with the other set too (a pair that
  needs several non-default values shares most of them with a found pair), then seeded random
  completions, and at the end the found witnesses again for the pairs still without one; a pair it
  finds no case for is reported as impossible (the caller's tests name those and say why).
* `Memo(allowed, factors)`: `allowed` memoised per case, to pass as `allowed` to both of the above when a caller
  runs them one after the other (each makes its own otherwise).
* `covering_set(factors, allowed, seed)`: allowed cases such that every pair with a witness is in at
  least one of them; greedy (AETG-like): each new case starts from an uncovered pair, fills the other
  factors with the value that covers most uncovered pairs and, when that case is not allowed, takes
  the pair's witness's values one factor at a time until it is; then the cases whose every pair another
  kept case also covers are dropped. Pure: the same arguments give the same cases.
"""
from __future__ import annotations

import itertools
import random
from typing import Callable, Iterable, Mapping

Value = object
Case = dict
Pair = tuple[tuple[str, Value], tuple[str, Value]]


def all_pairs(factors: Mapping[str, tuple]) -> list[Pair]:
    """Every pair of values of two different factors, in factor order."""
    names = list(factors)
    return [((a, va), (b, vb)) for a, b in itertools.combinations(names, 2)
            for va in factors[a] for vb in factors[b]]


def pairs_in(case: Mapping[str, Value], factors: Mapping[str, tuple]) -> set[Pair]:
    """The pairs a case covers."""
    names = list(factors)
    return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(names, 2)}


def product_size(factors: Mapping[str, tuple]) -> int:
    n = 1
    for values in factors.values():
        n *= len(values)
    return n


def full_product(factors: Mapping[str, tuple]) -> Iterable[Case]:
    """Every case of the product (unfiltered), in factor order."""
    names = list(factors)
    for values in itertools.product(*(factors[n] for n in names)):
        yield dict(zip(names, values))


class Memo:
    """`allowed` memoised per case: one object for one search (`find_witnesses` and then `covering_set` over the
    same factors validate many of the same cases; pass both the same Memo)."""

    def __init__(self, allowed: Callable[[Case], bool], factors: Mapping[str, tuple]):
        self.allowed, self.names, self.seen = allowed, list(factors), {}

    def __call__(self, case: Case) -> bool:
        key = tuple(case[n] for n in self.names)
        if key not in self.seen:
            self.seen[key] = bool(self.allowed(dict(case)))
        return self.seen[key]


def _neighbours(base: Case, fixed: set[str], factors: Mapping[str, tuple]) -> Iterable[Case]:
    """Cases one value away from `base`, never changing the factors in `fixed`."""
    for name in factors:
        if name not in fixed:
            for value in factors[name]:
                if value != base[name]:
                    yield {**base, name: value}


def _witness(pair: Pair, factors, allowed: Memo, rng: random.Random, random_tries: int,
             found: Iterable[Case] = ()) -> Case | None:
    (a, va), (b, vb) = pair
    base = {n: values[0] for n, values in factors.items()} | {a: va, b: vb}
    if allowed(base):
        return base
    for case in _neighbours(base, {a, b}, factors):
        if allowed(case):
            return case
    case = _from_found(pair, allowed, found)
    if case is not None:
        return case
    for _ in range(random_tries):
        case = {n: rng.choice(values) for n, values in factors.items()} | {a: va, b: vb}
        if allowed(case):
            return case
    return None


def _from_found(pair: Pair, allowed: Memo, found: Iterable[Case]) -> Case | None:
    """A found witness with the pair's values set, if allowed: first those already holding one of them, then
    any (a pair that needs several non-default values, such as an expert-parallel size, which needs the MoE
    model and a data-parallel size it divides, shares them with a found witness more often than a random
    case has them)."""
    (a, va), (b, vb) = pair
    holders, others = _split_by_holding(pair, found)
    for case in holders + others:
        case = case | {a: va, b: vb}
        if allowed(case):
            return case
    return None


def find_witnesses(factors: Mapping[str, tuple], allowed: Callable[[Case], bool], seed: int = 0,
                   random_tries: int = 200) -> dict[Pair, Case | None]:
    """{pair: an allowed case containing it, or None if the search found none}."""
    check = allowed if isinstance(allowed, Memo) else Memo(allowed, factors)
    rng = random.Random(seed)
    out: dict[Pair, Case | None] = {}
    found: dict[tuple, Case] = {}  # the distinct witnesses so far, in the order they were found
    for pair in all_pairs(factors):
        known = next((c for c in out.values() if c is not None and _contains(c, pair)), None)
        out[pair] = known if known is not None else _witness(pair, factors, check, rng, random_tries,
                                                             list(found.values()))
        if out[pair] is not None:
            found.setdefault(tuple(out[pair][n] for n in factors), out[pair])
    for pair in [p for p, w in out.items() if w is None]:  # again, from every witness found
        out[pair] = _from_found(pair, check, list(found.values())) or _near_found(pair, factors, check,
                                                                                   list(found.values()))
    return out


def _split_by_holding(pair: Pair, found: Iterable[Case]) -> tuple[list[Case], list[Case]]:
    """The found witnesses holding one of the pair's values, and the others."""
    (a, va), (b, vb) = pair
    found = list(found)
    return [c for c in found if c[a] == va or c[b] == vb], [c for c in found if c[a] != va and c[b] != vb]


def _near_found(pair: Pair, factors, allowed: Memo, found: list[Case]) -> Case | None:
    """A found witness holding one of the pair's values, with the other set and one more factor changed, if
    allowed: a pair that needs three values together (the interleaved schedule with an expert-parallel size
    needs two pipeline stages, which no MoE witness may have had)."""
    (a, va), (b, vb) = pair
    for case in _split_by_holding(pair, found)[0]:
        for changed in _neighbours(case | {a: va, b: vb}, {a, b}, factors):
            if allowed(changed):
                return changed
    return None


def _contains(case: Case, pair: Pair) -> bool:
    (a, va), (b, vb) = pair
    return case[a] == va and case[b] == vb


def covering_set(factors: Mapping[str, tuple], allowed: Callable[[Case], bool], seed: int = 0,
                 candidates: int = 8, witnesses: dict[Pair, Case | None] | None = None) -> list[Case]:
    """Allowed cases covering every pair that has a witness (see the module docstring); `witnesses`
    = `find_witnesses(factors, allowed, seed)` when already computed."""
    check = allowed if isinstance(allowed, Memo) else Memo(allowed, factors)
    if witnesses is None:
        witnesses = find_witnesses(factors, check, seed)
    uncovered = {p for p, w in witnesses.items() if w is not None}
    order = [p for p in all_pairs(factors) if p in uncovered]  # deterministic seed-pair order
    rng = random.Random(seed + 1)
    cases: list[Case] = []
    while uncovered:
        pair = next(p for p in order if p in uncovered)
        best = witnesses[pair]
        best_gain = len(pairs_in(best, factors) & uncovered)
        for _ in range(candidates):
            case = _repaired(_greedy(pair, factors, uncovered, rng), best, check)
            gain = len(pairs_in(case, factors) & uncovered)
            if gain > best_gain:
                best, best_gain = case, gain
        cases.append(best)
        uncovered -= pairs_in(best, factors)
    return _without_redundant(cases, factors)


def _without_redundant(cases: list[Case], factors) -> list[Case]:
    """`cases` less those whose every pair another remaining case also covers (greedy picks early cases for
    pairs that later cases cover again), dropped from the first on: the same pairs, fewer cases."""
    count: dict[Pair, int] = {}
    for case in cases:
        for p in pairs_in(case, factors):
            count[p] = count.get(p, 0) + 1
    kept = []
    for case in cases:
        mine = pairs_in(case, factors)
        if all(count[p] > 1 for p in mine):
            for p in mine:
                count[p] -= 1
        else:
            kept.append(case)
    return kept


def _repaired(case: Case, witness: Case, check: Memo) -> Case:
    """`case` if allowed, else `case` with its values replaced by the witness's one factor at a time
    (in factor order) until it is allowed; the witness itself at worst."""
    case = dict(case)
    for name in case:
        if check(case):
            return case
        case[name] = witness[name]
    return case


def _greedy(pair: Pair, factors, uncovered: set[Pair], rng: random.Random) -> Case:
    (a, va), (b, vb) = pair
    case: Case = {a: va, b: vb}
    rest = [n for n in factors if n not in case]
    rng.shuffle(rest)
    index = {n: i for i, n in enumerate(factors)}
    for name in rest:
        def gain(value):
            return sum(1 for other, ov in case.items()
                       if (((name, value), (other, ov)) if index[name] < index[other]
                           else ((other, ov), (name, value))) in uncovered)
        values = list(factors[name])
        rng.shuffle(values)
        case[name] = max(values, key=gain)
    return {n: case[n] for n in factors}
