"""Split a model's layers into pipeline stages (pure, no torch).

Input: one `LayerInfo` per layer (type name, parameter count, FLOPs), so a partition can be
computed and tested without building the model. Output: boundaries ``b`` with ``p * v + 1``
entries; virtual stage k (chunk ``k // p`` of stage ``k % p``, as in `instructions.virtual_stage`)
holds ``layers[b[k]:b[k + 1]]``.

Methods (``pipeline.partition``):

* ``"uniform"``: equal layer counts; the first ``N % parts`` parts get one extra layer.
* ``"parameters"``: balance parameter counts.
* ``"flops"``: balance per-layer cost (`LayerInfo.flops`; count the embedding and the head).
* ``"type:<regex>"``: balance the number of layers whose type name matches the regex
  (``re.search``, case-insensitive), e.g. ``"type:TransformerBlock"``.
* a list of per-part layer counts, e.g. ``[3, 4, 4, 3]`` (one per virtual stage).

Balancing is exact: the largest part weight is the smallest possible for contiguous parts; among
those partitions the one with the smallest sum of squared part weights is chosen (ties: earlier
parts larger), so a light stage is not left nearly empty.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence, Union

from megazero.core.suggest import closest

NAMED_METHODS = ("uniform", "parameters", "flops")
METHODS = NAMED_METHODS + ("type:<regex>",)
"""Partition methods; a list of per-part layer counts is also accepted."""


@dataclass(frozen=True)
class LayerInfo:
    """What partitioning needs to know about one layer."""

    name: str          # type name, matched by "type:<regex>" (e.g. "TransformerBlock")
    params: int = 0    # parameter count
    flops: float = 0.0  # cost per micro-batch (any unit, forward + backward)


def _check_counts(num_layers: int, num_stages: int, chunks: int) -> int:
    for arg, value in (("num_stages", num_stages), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg}={value!r} must be an integer >= 1")
    parts = num_stages * chunks
    if parts > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into num_stages={num_stages} x chunks={chunks} = {parts} "
                         f"parts: every (virtual) stage needs at least one layer")
    return parts


def _from_counts(counts: Sequence[int], num_layers: int, parts: int) -> tuple[int, ...]:
    if len(counts) != parts:
        raise ValueError(f"partition list {list(counts)} has {len(counts)} entries but needs one layer count per "
                         f"virtual stage: num_stages x chunks = {parts}")
    for i, c in enumerate(counts):
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"partition[{i}]={c!r} must be an integer >= 1 (a stage needs at least one layer)")
    if sum(counts) != num_layers:
        raise ValueError(f"partition list {list(counts)} sums to {sum(counts)} but the model has {num_layers} layers")
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return tuple(bounds)


def _uniform(num_layers: int, parts: int) -> tuple[int, ...]:
    size, extra = divmod(num_layers, parts)
    return _from_counts([size + (i < extra) for i in range(parts)], num_layers, parts)


def _weights(layers: Sequence[LayerInfo], method: str) -> list[float]:
    if method == "parameters":
        weights, what = [layer.params for layer in layers], "params"
    elif method == "flops":
        weights, what = [layer.flops for layer in layers], "flops"
    else:
        pattern = method[len("type:"):]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as exc:
            raise ValueError(f"partition {method!r}: bad regular expression {pattern!r}: {exc}") from None
        weights = [1 if regex.search(layer.name) else 0 for layer in layers]
        if not any(weights):
            names = sorted({layer.name for layer in layers})
            raise ValueError(f"partition {method!r} matches no layer type; the types are {', '.join(names)}")
        return weights
    for i, w in enumerate(weights):
        if not isinstance(w, (int, float)) or isinstance(w, bool) or w < 0 or w != w:
            raise ValueError(f"partition {method!r}: layer {i} ({layers[i].name}) has {what}={w!r}; "
                             f"it must be a number >= 0")
    if not any(weights):
        raise ValueError(f"partition {method!r} needs per-layer {what}, but every layer has {what}=0")
    return weights


def _greedy_parts(prefix: list[float], cap: float) -> tuple[int, float]:
    """(number of parts, largest part) when each part takes layers while its weight stays <= cap."""
    count, start, largest = 1, 0, 0.0
    for i in range(1, len(prefix)):
        if prefix[i] - prefix[start] > cap:
            largest = max(largest, prefix[i - 1] - prefix[start])
            count, start = count + 1, i - 1
    return count, max(largest, prefix[-1] - prefix[start])


def _min_bottleneck(prefix: list[float], weights: list[float], parts: int) -> float:
    """The smallest achievable largest part weight (an actual part sum, so comparisons are exact)."""
    lo, hi = max(weights), prefix[-1]
    if _greedy_parts(prefix, lo)[0] <= parts:
        return _greedy_parts(prefix, lo)[1]
    for _ in range(200):  # lo infeasible, hi feasible
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if _greedy_parts(prefix, mid)[0] <= parts:
            hi = mid
        else:
            lo = mid
    return _greedy_parts(prefix, hi)[1]


def _balanced(weights: list[float], parts: int) -> tuple[int, ...]:
    """Contiguous split minimising the largest part, then the sum of squared part weights."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    cap = _min_bottleneck(prefix, weights, parts)
    inf = float("inf")
    # best[k][i]: least sum of squares splitting layers[:i] into k parts each <= cap
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    choice = [[-1] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(i - 1, k - 2, -1):  # last part is layers[j:i]
                part = prefix[i] - prefix[j]
                if part > cap:
                    break
                cost = best[k - 1][j] + part * part
                if cost < best[k][i]:
                    best[k][i], choice[k][i] = cost, j
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(choice[k][bounds[-1]])
    return tuple(reversed(bounds))


def partition(layers: Sequence[LayerInfo], num_stages: int, method: Union[str, Sequence[int]] = "parameters",
              chunks: int = 1) -> tuple[int, ...]:
    """Boundaries of the ``num_stages * chunks`` contiguous parts of `layers` (see the module docstring).

    Raises:
        ValueError: more parts than layers, an unknown method, a bad regex or layer-count list.
    """
    parts = _check_counts(len(layers), num_stages, chunks)
    if not isinstance(method, str):
        return _from_counts(list(method), len(layers), parts)
    if method == "uniform":
        return _uniform(len(layers), parts)
    if method in ("parameters", "flops") or method.startswith("type:"):
        return _balanced(_weights(layers, method), parts)
    close = closest(method, NAMED_METHODS + ("type:",))
    hint = f"did you mean {close!r}? " if close else ""
    raise ValueError(f"unknown partition method {method!r} (pipeline.partition); {hint}valid methods are "
                     f"{', '.join(METHODS)}, or a list of per-stage layer counts")


def stage_layers(boundaries: Sequence[int], stage: int, num_stages: int, chunk: int = 0) -> range:
    """Indices of the layers held by `chunk` of `stage` (virtual stage ``chunk * num_stages + stage``)."""
    k = chunk * num_stages + stage
    if not 0 <= stage < num_stages or not 0 <= k < len(boundaries) - 1:
        raise ValueError(f"stage={stage}, chunk={chunk} is outside the {len(boundaries) - 1} parts of "
                         f"num_stages={num_stages}")
    return range(boundaries[k], boundaries[k + 1])


def part_weights(layers: Sequence[LayerInfo], boundaries: Sequence[int], key: str = "params") -> list[float]:
    """Total `key` ("params" or "flops") of each part; handy to report how balanced a split is."""
    if key not in ("params", "flops"):
        raise ValueError(f"key={key!r} must be 'params' or 'flops'")
    return [sum(getattr(layer, key) for layer in layers[a:b]) for a, b in zip(boundaries, boundaries[1:])]


def segment_sizes(num_blocks: int, every_k: int, number: int | None) -> list[int]:
    """Block counts of the checkpointed segments of a chunk of `num_blocks` consecutive blocks under
    ``activation_checkpointing.policy=full``: `number` (number_checkpoints) segments as even as possible
    (at most one per block), else runs of `every_k` (every_k_layers) blocks."""
    if number is not None:
        n = min(number, num_blocks)
        bounds = [round(i * num_blocks / n) for i in range(n + 1)]
        return [b - a for a, b in zip(bounds, bounds[1:])]
    return [min(every_k, num_blocks - i) for i in range(0, num_blocks, every_k)]
