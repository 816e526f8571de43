"""Pure grid arithmetic for a PP x DP x TP (x EP x CP) process grid.

No torch.distributed here: a `Topology` maps global ranks to coordinates on named axes and
lists the ranks of every axis group. Only `megazero/runtime/parallel_context.py` turns those rank lists into
process groups.

Ranks are laid out row-major over `order` (outermost axis first), so with the default order
``("pp", "dp", "tp")`` the TP axis is innermost and TP groups are runs of consecutive ranks
(NVLink neighbours on a node):

    >>> Topology(pp=2, dp=2, tp=2).axis_groups("tp")
    [[0, 1], [2, 3], [4, 5], [6, 7]]
"""
from __future__ import annotations

import itertools
import math
from typing import Iterable, NamedTuple, Sequence

KNOWN_AXES = ("pp", "dp", "ep", "cp", "tp")
"""Every axis megazero knows, outermost first: the default order keeps this relative order."""


class Coord(NamedTuple):
    """A rank's position on the grid, one field per axis (missing axes have coordinate 0)."""

    pp: int
    dp: int
    ep: int
    cp: int
    tp: int


class Topology:
    """An immutable grid of ranks over named axes, row-major: the last axis of `order` varies fastest.

    Args:
        order: axis names outermost to innermost. Defaults to ``("pp", "dp", "tp")`` with any
            extra axis (``ep``, ``cp``) inserted in the position `KNOWN_AXES` gives it.
        **sizes: the size of each axis, e.g. ``pp=2, dp=4, tp=8``. Axes of `KNOWN_AXES` not given have
            size 1. Any other name is an axis too when `order` places it and its size is given (DeepSpeed's
            ``ProcessTopology(["x", "y"], [2, 3])`` is ``Topology.of(["x", "y"], [2, 3])``); megazero's own
            layers use the known axes only.
    """

    def __init__(self, order: Iterable[str] | None = None, **sizes: int) -> None:
        self._build(None if order is None else tuple(order), sizes)

    @classmethod
    def of(cls, axes: Sequence[str], dims: Sequence[int]) -> "Topology":
        """The grid of `axes` (any names, outermost first) with sizes `dims`, one per axis."""
        axes, dims = tuple(axes), tuple(dims)
        if len(axes) != len(dims):
            raise ValueError(f"Topology.of(axes={list(axes)}, dims={list(dims)}): give one size per axis")
        t = cls.__new__(cls)
        t._build(axes, dict(zip(axes, dims, strict=True)))
        return t

    def _build(self, order: tuple[str, ...] | None, sizes: dict) -> None:
        for name, size in sizes.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"axis name {name!r} must be a non-empty string")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"axis size {name}={size!r} must be a positive integer")
        if order is None:
            unknown = [a for a in sizes if a not in KNOWN_AXES]
            if unknown:
                raise ValueError(f"unknown axis {unknown[0]!r}; the default order lays out {', '.join(KNOWN_AXES)}: "
                                 f"give order=(...) to place another axis")
            used = [a for a in KNOWN_AXES if a in sizes or a in ("pp", "dp", "tp")]
        else:
            used = list(order)
            if len(set(used)) != len(used):
                raise ValueError(f"order {tuple(used)} repeats an axis")
            unsized = [a for a in used if a not in KNOWN_AXES and a not in sizes]
            if unsized:
                raise ValueError(f"order names axis {unsized[0]!r} without a size; axes other than "
                                 f"{', '.join(KNOWN_AXES)} need their size given")
            missing = [a for a, n in sizes.items() if a not in used and (n > 1 or a not in KNOWN_AXES)]
            if missing:
                raise ValueError(f"axis {missing[0]!r} has a size but is not in order {tuple(used)}")
        self._order: tuple[str, ...] = tuple(used)
        self._sizes: dict[str, int] = {a: sizes.get(a, 1) for a in self._order}
        self._world = math.prod(self._sizes.values())
        # stride of each axis in the row-major layout
        strides, acc = {}, 1
        for axis in reversed(self._order):
            strides[axis] = acc
            acc *= self._sizes[axis]
        self._strides = strides

    # -- basic facts ------------------------------------------------------------------
    @property
    def order(self) -> tuple[str, ...]:
        return self._order

    @property
    def world_size(self) -> int:
        return self._world

    def size(self, axis: str) -> int:
        """Size of `axis` (1 for a known axis that this grid does not use)."""
        if axis in self._sizes:
            return self._sizes[axis]
        if axis not in KNOWN_AXES:
            raise ValueError(f"unknown axis {axis!r}; valid axes are {', '.join(dict.fromkeys(KNOWN_AXES + self._order))}")
        return 1

    @property
    def pp(self) -> int:
        return self.size("pp")

    @property
    def dp(self) -> int:
        return self.size("dp")

    @property
    def tp(self) -> int:
        return self.size("tp")

    def __repr__(self) -> str:
        sizes = ", ".join(f"{a}={self._sizes[a]}" for a in self._order)
        return f"Topology({sizes}, order={self._order})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and self._order == other._order and self._sizes == other._sizes

    def __hash__(self) -> int:
        return hash((self._order, tuple(self._sizes.items())))

    def renamed(self, names: dict[str, str]) -> "Topology":
        """The same layout with axis ``a`` called ``names.get(a, a)`` (every rank keeps its coordinates)."""
        axes = [names.get(a, a) for a in self._order]
        return Topology.of(axes, [self._sizes[a] for a in self._order])

    # -- rank <-> coordinates ------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self._world:
            raise ValueError(f"rank {rank} is outside the grid of {self._world} ranks")

    def position(self, rank: int) -> dict[str, int]:
        """Coordinates of global `rank` on this grid's axes, in `order` (any axis names)."""
        self._check_rank(rank)
        return {a: (rank // self._strides[a]) % self._sizes[a] for a in self._order}

    def coords(self, rank: int) -> Coord:
        """Coordinates of global `rank` on every known axis (a grid of other axes: use `position`)."""
        c = self.position(rank)
        other = [a for a in self._order if a not in KNOWN_AXES]
        if other:
            raise ValueError(f"coords: axis {other[0]!r} is not one of {', '.join(KNOWN_AXES)}; use position(rank)")
        return Coord(**{a: c.get(a, 0) for a in KNOWN_AXES})

    def rank(self, /, **coords: int) -> int:
        """Global rank at the given coordinates (axes not named are 0)."""
        r = 0
        for axis, value in coords.items():
            n = self.size(axis)
            if not 0 <= value < n:
                raise ValueError(f"coordinate {axis}={value} is outside 0..{n - 1}")
            if axis in self._strides:
                r += value * self._strides[axis]
        return r

    def matching(self, /, **fixed: int) -> list[int]:
        """The ranks whose coordinates are `fixed` on the axes named (any value on the others), ascending."""
        return self.group_of(self.rank(**fixed), *[a for a in self._order if a not in fixed])

    # -- groups ----------------------------------------------------------------------------
    def axis_groups(self, *axes: str) -> list[list[int]]:
        """Rank lists of the groups that vary over `axes` with every other axis fixed.

        One axis gives that axis' groups; several give combined groups, e.g.
        ``axis_groups("pp", "tp")`` is the model-parallel groups. Groups are listed in order of
        the fixed coordinates (outermost first); ranks inside a group are ascending.
        """
        if not axes:
            raise ValueError("axis_groups needs at least one axis name")
        for a in axes:
            self.size(a)  # validates the name
        inner = [a for a in self._order if a in axes]
        outer = [a for a in self._order if a not in axes]
        groups = []
        for fixed in itertools.product(*(range(self._sizes[a]) for a in outer)):
            base = sum(v * self._strides[a] for a, v in zip(outer, fixed))
            members = [
                base + sum(v * self._strides[a] for a, v in zip(inner, var))
                for var in itertools.product(*(range(self._sizes[a]) for a in inner))
            ]
            groups.append(sorted(members))
        return groups

    def group_of(self, rank: int, *axes: str) -> list[int]:
        """The ranks of the group over `axes` that contains `rank`."""
        c = self.position(rank)
        fixed = {a: c[a] for a in self._order if a not in axes}
        inner = [a for a in self._order if a in axes]
        members = [
            self.rank(**fixed, **dict(zip(inner, var)))
            for var in itertools.product(*(range(self._sizes[a]) for a in inner))
        ]
        return sorted(members)

    def model_parallel_groups(self) -> list[list[int]]:
        """Groups spanning pp x tp (x ep x cp): the ranks that together hold one model replica."""
        return self.axis_groups(*[a for a in self._order if a != "dp"])

    def expert_groups(self, ep: int) -> list[list[int]]:
        """Expert-parallel groups carved out of the data axis: each dp group (in dp order) split into
        runs of `ep` consecutive dp ranks; the ranks of one run hold different experts and exchange
        tokens. ``Topology(dp=4).expert_groups(2) == [[0, 1], [2, 3]]``."""
        return self.data_parallel_runs(ep)

    def data_parallel_runs(self, k: int) -> list[list[int]]:
        """Each dp group (in dp order) split into runs of `k` consecutive dp ranks: expert-parallel groups,
        and ZeRO++'s hpZ groups (one node's ranks of a dp group when k is the ranks per node)."""
        return [g[i:i + k] for g in self._dp_runs(k) for i in range(0, len(g), k)]

    def expert_data_groups(self, ep: int) -> list[list[int]]:
        """Expert-data-parallel groups: the dp ranks that hold the same experts (dp rank ≡ j mod ep),
        over which expert gradients are reduced. ``Topology(dp=4).expert_data_groups(2) == [[0, 2], [1, 3]]``."""
        return [g[j::ep] for g in self._dp_runs(ep) for j in range(ep)]

    def expert_data_cp_groups(self, ep: int) -> list[list[int]]:
        """With context parallelism, the ranks holding the same experts: those of `expert_data_groups` and their
        cp peers (which route other tokens of the same sequences to the same experts), over which expert
        gradients are reduced. ``Topology(dp=2, cp=2).expert_data_cp_groups(2) == [[0, 1], [2, 3]]``."""
        self._dp_runs(ep)  # validates ep
        return [sorted(r for r in g if self.position(r).get("dp", 0) % ep == j)
                for g in self.axis_groups("dp", "cp") for j in range(ep)]

    def _dp_runs(self, ep: int) -> list[list[int]]:
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or self.dp % ep:
            raise ValueError(f"parallel.ep={ep!r} must be a positive integer dividing dp={self.dp}")
        return [sorted(g, key=lambda r: self.position(r).get("dp", 0)) for g in self.axis_groups("dp")]

    def embedding_groups(self) -> list[list[int]]:
        """For tied input/output embeddings: the first and last pipeline stage's ranks that share
        every other coordinate. With pp=1 each group is a single rank."""
        groups = []
        for g in self.axis_groups("pp"):
            groups.append(sorted({g[0], g[-1]}))
        return groups

    def pipeline_peers(self, rank: int, wrap: bool = False) -> tuple[int | None, int | None]:
        """(previous, next) pipeline stage ranks of `rank`, or None at the ends.

        With ``wrap=True`` the last stage's next is stage 0 and vice versa (interleaved schedules).
        """
        c = self.position(rank)
        pp = self.pp
        others = {a: c[a] for a in self._order if a != "pp"}
        stage = c.get("pp", 0)
        prev_stage, next_stage = stage - 1, stage + 1
        if wrap:
            prev_stage, next_stage = prev_stage % pp, next_stage % pp
        prev = self.rank(pp=prev_stage, **others) if 0 <= prev_stage < pp else None
        nxt = self.rank(pp=next_stage, **others) if 0 <= next_stage < pp else None
        return prev, nxt
