"""Pipeline instructions: the data a schedule is made of (pure, no torch).

A *program* is the tuple of instructions one pipeline stage executes for one training step.
Every instruction is a frozen dataclass with a short repr, so a program prints compactly:

    >>> render((RecvAct(0, peer=0), Forward(0), SendAct(0, peer=2), ReduceGrads(), OptimizerStep()))
    'RA0<0 F0 SA0>2 Reduce Step'

Conventions the executor relies on:

* ``mb`` is the micro-batch index, ``chunk`` the *local* model chunk on the executing stage
  (always 0 without interleaving). With ``p`` stages, chunk ``c`` of stage ``s`` holds the virtual
  stage ``c * p + s`` (Megatron's layout), so activations flow stage 0 -> p-1 for chunk 0, then
  wrap around from stage p-1 chunk c to stage 0 chunk c+1.
* ``peer`` is the pipeline stage index (pp coordinate) on the other end of a point-to-point
  transfer; the executor maps it to a global rank with the topology.
* Messages number instructions from 1 ("instruction 6 of 40"), as the executor does.
* Sends and receives are *blocking and pairwise*: the k-th send from stage a to stage b is received
  by the k-th receive at b from a, and neither completes before both are posted. Schedules order
  them so that this cannot deadlock; `megazero.core.simulate` checks it. On NCCL the executor
  posts each run of consecutive transfers (`p2p_runs`) as one batch and waits for all of it before
  the next instruction: that only removes waits, so a program that cannot deadlock blocking cannot
  deadlock batched.
* ``Backward`` is a full backward (input and weight grads). Zero-bubble schedules split it into
  ``BackwardInput`` (input grad, the critical path) and ``BackwardWeight`` (weight grad, deferred).
  Both ``Backward`` and ``BackwardInput`` print as ``B3``; a program containing ``W3`` for the same
  micro-batch chunk marks its ``B3`` as input-only (how `parse_program` tells them apart).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Iterable, Sequence, Union


class ScheduleError(ValueError):
    """A schedule, program or schedule file that cannot run; the message says where and why.
    `key` is the config key the problem belongs to, when there is one (``pipeline.chunks``)."""

    def __init__(self, message: str, key: str = "pipeline.schedule") -> None:
        super().__init__(message)
        self.key = key


def virtual_stage(stage: int, chunk: int, num_stages: int) -> int:
    """Index of the virtual stage held by `chunk` of `stage` (Megatron layout ``chunk * p + stage``)."""
    return chunk * num_stages + stage


def stage_and_chunk(vstage: int, num_stages: int) -> tuple[int, int]:
    """Inverse of `virtual_stage`: the (stage, chunk) holding virtual stage `vstage`."""
    return vstage % num_stages, vstage // num_stages


def _chunk_suffix(chunk: int) -> str:
    return f"c{chunk}" if chunk else ""


def _chunk_words(chunk: int) -> str:
    return f" chunk {chunk}" if chunk else ""


@dataclass(frozen=True, repr=False)
class LoadMicroBatch:
    """Pull micro-batch `mb` from the data iterator: inputs on stage 0, labels on the last stage."""

    mb: int

    def __repr__(self) -> str:
        return f"L{self.mb}"

    def describe(self) -> str:
        return f"LoadMicroBatch mb {self.mb}"


@dataclass(frozen=True, repr=False)
class _ChunkOp:
    """Compute on micro-batch `mb` with local model chunk `chunk`."""

    mb: int
    chunk: int = 0
    letter: ClassVar[str] = "?"

    def __repr__(self) -> str:
        return f"{self.letter}{self.mb}{_chunk_suffix(self.chunk)}"

    def describe(self) -> str:
        return f"{type(self).__name__} mb {self.mb}{_chunk_words(self.chunk)}"


@dataclass(frozen=True, repr=False)
class Forward(_ChunkOp):
    """Forward of `chunk` on micro-batch `mb`; keeps what the backward needs. Prints ``F3``."""

    letter: ClassVar[str] = "F"


@dataclass(frozen=True, repr=False)
class Backward(_ChunkOp):
    """Full backward (input grad and weight grads) of `chunk` on `mb`; frees its activations. ``B3``."""

    letter: ClassVar[str] = "B"


@dataclass(frozen=True, repr=False)
class BackwardInput(_ChunkOp):
    """Zero-bubble B: the grad w.r.t. the chunk's input only; keeps what W needs. Prints ``B3``."""

    letter: ClassVar[str] = "B"


@dataclass(frozen=True, repr=False)
class BackwardWeight(_ChunkOp):
    """Zero-bubble W: the weight grads of a chunk whose BackwardInput ran; frees the rest. ``W3``."""

    letter: ClassVar[str] = "W"


@dataclass(frozen=True, repr=False)
class _P2P:
    """A blocking point-to-point transfer of one tensor for (`mb`, local `chunk`) with stage `peer`."""

    mb: int
    chunk: int
    peer: int
    code: ClassVar[str] = "??"
    arrow: ClassVar[str] = "?"
    preposition: ClassVar[str] = "?"

    def __repr__(self) -> str:
        return f"{self.code}{self.mb}{_chunk_suffix(self.chunk)}{self.arrow}{self.peer}"

    def describe(self) -> str:
        return f"{type(self).__name__} mb {self.mb}{_chunk_words(self.chunk)} {self.preposition} stage {self.peer}"


@dataclass(frozen=True, repr=False)
class SendAct(_P2P):
    """Send the output activation of local `chunk` for `mb` to stage `peer`. Prints ``SA3>2``."""

    code: ClassVar[str] = "SA"
    arrow: ClassVar[str] = ">"
    preposition: ClassVar[str] = "to"


@dataclass(frozen=True, repr=False)
class RecvAct(_P2P):
    """Receive the input activation of local `chunk` for `mb` from stage `peer`. Prints ``RA3<0``."""

    code: ClassVar[str] = "RA"
    arrow: ClassVar[str] = "<"
    preposition: ClassVar[str] = "from"


@dataclass(frozen=True, repr=False)
class SendGrad(_P2P):
    """Send the grad w.r.t. local `chunk`'s input for `mb` to stage `peer`. Prints ``SG3>0``."""

    code: ClassVar[str] = "SG"
    arrow: ClassVar[str] = ">"
    preposition: ClassVar[str] = "to"


@dataclass(frozen=True, repr=False)
class RecvGrad(_P2P):
    """Receive the grad w.r.t. local `chunk`'s output for `mb` from stage `peer`. Prints ``RG3<2``."""

    code: ClassVar[str] = "RG"
    arrow: ClassVar[str] = "<"
    preposition: ClassVar[str] = "from"


@dataclass(frozen=True, repr=False)
class ReduceGrads:
    """Reduce the accumulated grads over the data-parallel group (and tied weights over their group)."""

    def __repr__(self) -> str:
        return "Reduce"

    def describe(self) -> str:
        return "ReduceGrads"


@dataclass(frozen=True, repr=False)
class OptimizerStep:
    """Clip, step the optimizer and refresh the working parameters."""

    def __repr__(self) -> str:
        return "Step"

    def describe(self) -> str:
        return "OptimizerStep"


Instruction = Union[
    LoadMicroBatch, Forward, Backward, BackwardInput, BackwardWeight,
    SendAct, RecvAct, SendGrad, RecvGrad, ReduceGrads, OptimizerStep,
]

COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)
"""Instructions that run a model chunk on a micro-batch."""
BACKWARD_INPUT = (Backward, BackwardInput)
"""Instructions after which the chunk's input grad exists (and can be sent upstream)."""
SENDS = (SendAct, SendGrad)
RECVS = (RecvAct, RecvGrad)
P2P = SENDS + RECVS
PER_MICROBATCH = (LoadMicroBatch,) + COMPUTE + P2P
"""The instructions that act on one micro-batch (they have an `mb`; ReduceGrads and OptimizerStep act on the step)."""


def p2p_runs(program: Sequence[Instruction]) -> tuple[tuple[int, int], ...]:
    """The maximal runs of consecutive point-to-point instructions in `program`, as (start, stop)
    index ranges in program order: what a batched executor (NCCL) posts as one batch each.
    ``p2p_runs(parse_program("RA0<0 F0 SA0>2 RG0<2 B0"))`` is ``((0, 1), (2, 4))``."""
    runs, start = [], None
    for i, ins in enumerate(program):
        if isinstance(ins, P2P):
            start = i if start is None else start
        elif start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(program)))
    return tuple(runs)


def render(program: Iterable[Instruction], sep: str = " ") -> str:
    """The compact string of a program, e.g. ``'L0 F0 SA0>1 F1 ... Reduce Step'``."""
    return sep.join(repr(ins) for ins in program)


_TOKEN = re.compile(r"(?P<op>SA|RA|SG|RG|F|B|W|L)(?P<mb>\d+)(?:c(?P<chunk>\d+))?(?:(?P<arrow>[<>])(?P<peer>\d+))?")
_P2P_BY_CODE = {cls.code: cls for cls in (SendAct, RecvAct, SendGrad, RecvGrad)}
_CHUNK_OP_BY_LETTER = {"F": Forward, "B": Backward, "W": BackwardWeight}
TOKEN_FORMS = "F3, F3c1, B3, W3, L3, SA3>1, RA3<0, SG3>0, RG3<2, Reduce, Step"


def parse_action(token: str) -> Instruction:
    """Parse one short repr (``F3c1``, ``SA3>1``, ``Reduce`` ...). ``B3`` parses as a full `Backward`;
    `parse_program` turns it into `BackwardInput` when the program also has ``W3``."""
    if token == "Reduce":
        return ReduceGrads()
    if token == "Step":
        return OptimizerStep()
    match = _TOKEN.fullmatch(token)
    if match is None:
        raise ScheduleError(f"cannot parse action {token!r}; valid forms are {TOKEN_FORMS}")
    op, mb, chunk = match["op"], int(match["mb"]), int(match["chunk"] or 0)
    if op in _P2P_BY_CODE:
        cls = _P2P_BY_CODE[op]
        if match["arrow"] != cls.arrow:
            raise ScheduleError(f"action {token!r}: {op} needs '{cls.arrow}peer' (e.g. {cls(3, 0, 1)!r})")
        return cls(mb, chunk, int(match["peer"]))
    if match["arrow"] is not None:
        raise ScheduleError(f"action {token!r}: only sends and receives name a peer stage")
    if op == "L":
        if chunk:
            raise ScheduleError(f"action {token!r}: LoadMicroBatch has no chunk")
        return LoadMicroBatch(mb)
    return _CHUNK_OP_BY_LETTER[op](mb, chunk)


def split_backwards(program: Sequence[Instruction]) -> tuple[Instruction, ...]:
    """Turn each full `Backward` whose (mb, chunk) also has a `BackwardWeight` into `BackwardInput`."""
    with_w = {(ins.mb, ins.chunk) for ins in program if isinstance(ins, BackwardWeight)}
    return tuple(
        BackwardInput(ins.mb, ins.chunk) if isinstance(ins, Backward) and (ins.mb, ins.chunk) in with_w else ins
        for ins in program
    )


def parse_program(text: str) -> tuple[Instruction, ...]:
    """Parse a whitespace-separated program (the inverse of `render`)."""
    return split_backwards([parse_action(tok) for tok in text.split()])


# -- structural checks -----------------------------------------------------------------------------

def _key(ins: Instruction) -> tuple:
    """Identity of an instruction within one program (each may appear once)."""
    if isinstance(ins, (ReduceGrads, OptimizerStep)):
        return (type(ins).__name__,)
    if isinstance(ins, LoadMicroBatch):
        return ("L", ins.mb)
    if isinstance(ins, P2P):
        return (ins.code, ins.mb, ins.chunk)
    if isinstance(ins, COMPUTE):
        return (ins.letter, ins.mb, ins.chunk)
    raise ScheduleError(f"{ins!r} of type {type(ins).__name__} is not a pipeline instruction")


def _index(stage: int, program: Sequence[Instruction]) -> dict[tuple, tuple[int, Instruction]]:
    seen: dict[tuple, tuple[int, Instruction]] = {}
    for i, ins in enumerate(program):
        key = _key(ins)
        if key in seen:
            raise ScheduleError(f"stage {stage}: {ins.describe()} appears twice "
                                f"(instructions {seen[key][0] + 1} and {i + 1})")
        seen[key] = (i, ins)
    return seen


def _require_order(stage: int, idx: dict, first: tuple, then: tuple) -> None:
    """`first` must exist and come before `then` (which exists)."""
    later = idx[then][1]
    if first not in idx:
        raise ScheduleError(f"stage {stage}: {later.describe()} has no {_name(first)} before it")
    if idx[first][0] > idx[then][0]:
        raise ScheduleError(f"stage {stage}: {idx[first][1].describe()} (instruction {idx[first][0] + 1}) must come "
                            f"before {later.describe()} (instruction {idx[then][0] + 1})")


def _name(key: tuple) -> str:
    names = {"F": "Forward", "B": "Backward", "W": "BackwardWeight", "L": "LoadMicroBatch", "SA": "SendAct",
             "RA": "RecvAct", "SG": "SendGrad", "RG": "RecvGrad"}
    words = [names.get(key[0], key[0])]
    if len(key) > 1:
        words.append(f"mb {key[1]}")
    if len(key) > 2 and key[2]:
        words.append(f"chunk {key[2]}")
    return " ".join(words)


def _check_compute(stage: int, idx: dict) -> set[tuple[int, int]]:
    """F before B before W for each micro-batch chunk; returns the chunks' (mb, chunk) pairs."""
    work = {(k[1], k[2]) for k in idx if k[0] in ("F", "B", "W")}
    for mb, chunk in sorted(work):
        f, b, w = ("F", mb, chunk), ("B", mb, chunk), ("W", mb, chunk)
        for key in (b, f):
            if key not in idx:
                raise ScheduleError(f"stage {stage}: {_name(key)} is missing (the chunk has other work)")
        _require_order(stage, idx, f, b)
        split = isinstance(idx[b][1], BackwardInput)
        if split and w not in idx:
            raise ScheduleError(f"stage {stage}: {idx[b][1].describe()} has no BackwardWeight after it")
        if w in idx:
            if not split:
                raise ScheduleError(f"stage {stage}: {idx[w][1].describe()} follows a full Backward "
                                    f"(use BackwardInput when the weight grad is a separate W)")
            _require_order(stage, idx, b, w)
    return work


def _check_same_work(works: Sequence[set[tuple[int, int]]]) -> tuple[int, int]:
    """Every stage must run every (mb, chunk) for mb < m, chunk < v; returns (m, v)."""
    every = set().union(*works)
    if not every:
        raise ScheduleError("the programs run no micro-batch")
    m, v = 1 + max(mb for mb, _ in every), 1 + max(c for _, c in every)
    for stage, work in enumerate(works):
        missing = sorted({(mb, c) for mb in range(m) for c in range(v)} - work)
        if missing:
            mb, c = missing[0]
            raise ScheduleError(f"stage {stage} never runs mb {mb}{_chunk_words(c)} "
                                f"({len(missing)} micro-batch chunks missing; every stage runs mb < {m}, chunk < {v})")
    if v > 1 and len(works) < 2:
        raise ScheduleError(f"{v} chunks on a single stage: interleaving needs at least 2 stages")
    return m, v


def check_orders(orders: Sequence[Sequence[Instruction]]) -> tuple[int, int]:
    """Validate per-stage compute orders (F/B/W only); returns (num_microbatches, chunks)."""
    works = []
    for stage, order in enumerate(orders):
        for ins in order:
            if not isinstance(ins, COMPUTE):
                raise ScheduleError(f"stage {stage}: compute orders hold only F, B and W, not {ins!r}")
        works.append(_check_compute(stage, _index(stage, order)))
    return _check_same_work(works)


def _expected_io(stage: int, mb: int, chunk: int, p: int, v: int) -> list[tuple[tuple, tuple, int | None]]:
    """(earlier key, later key, peer of the transfer or None) that one chunk of work requires."""
    vs, last = virtual_stage(stage, chunk, p), p * v - 1
    f, b = ("F", mb, chunk), ("B", mb, chunk)
    prev_stage, next_stage = (stage - 1) % p, (stage + 1) % p
    io = []
    if vs == 0 or vs == last:
        io.append((("L", mb), f, None))
    if vs > 0:
        io += [(("RA", mb, chunk), f, prev_stage), (b, ("SG", mb, chunk), prev_stage)]
    if vs < last:
        io += [(f, ("SA", mb, chunk), next_stage), (("RG", mb, chunk), b, next_stage)]
    return io


def check_programs(programs: Sequence[Sequence[Instruction]]) -> tuple[int, int]:
    """Validate each stage's program on its own; returns (num_microbatches, chunks).

    Each micro-batch chunk runs F before B before W; receives precede their use and sends follow
    the production, with the right peer; loads happen on the first and last virtual stage only;
    each program ends in ReduceGrads, OptimizerStep. Whether the stages fit together (pairing,
    deadlock) is `simulate`'s job.
    """
    p = len(programs)
    indexes = [_index(stage, program) for stage, program in enumerate(programs)]
    m, v = _check_same_work([_check_compute(stage, idx) for stage, idx in enumerate(indexes)])
    for stage, (program, idx) in enumerate(zip(programs, indexes)):
        expected = {("ReduceGrads",), ("OptimizerStep",)}
        for mb in range(m):
            for chunk in range(v):
                expected |= {("F", mb, chunk), ("B", mb, chunk), ("W", mb, chunk)}
                for first, then, peer in _expected_io(stage, mb, chunk, p, v):
                    comm = first if first[0] in ("RA", "RG") else then
                    if then not in idx:  # `first` is then the chunk's F or B, which exists
                        raise ScheduleError(f"stage {stage}: {idx[first][1].describe()} has no {_name(then)} after it")
                    _require_order(stage, idx, first, then)
                    if peer is not None and idx[comm][1].peer != peer:
                        raise ScheduleError(f"stage {stage}: {idx[comm][1].describe()} has the wrong peer; "
                                            f"it must be stage {peer}")
                    expected |= {first, then}
        extra = sorted((idx[k][0] for k in idx if k not in expected))
        if extra:
            raise ScheduleError(f"stage {stage}: unexpected {program[extra[0]].describe()} "
                                f"(instruction {extra[0] + 1})")
        if tuple(program[-2:]) != (ReduceGrads(), OptimizerStep()):
            raise ScheduleError(f"stage {stage}: the program must end with ReduceGrads, OptimizerStep "
                                f"(it ends with {render(program[-2:])})")
    return m, v
