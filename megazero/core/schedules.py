"""Pipeline schedules as data (pure, cached, no torch).

A schedule is first a *compute order* per stage: the sequence of F, B and W instructions. From it,
`build_programs` derives the complete programs: the sends and receives, the loads and the final
ReduceGrads, OptimizerStep. Every schedule here (and every CSV schedule) goes through it, so the
communication rules live in one place:

* Transfers are blocking and pairwise (gloo send/recv, no batched isend/irecv). `build_programs`
  runs the compute orders in simulated time (unit t_F = t_B = t_W by default, or given costs)
  with blocking transfers: a transfer
  happens as soon as both of its stages are between instructions, and a stage whose next
  instruction has its input starts it instead of waiting to send. The order in which things
  happened becomes each stage's program. Every program is then sorted by one global clock, both
  ends of a transfer at the same instant and simultaneous transfers in one global order, so the
  earliest unexecuted instruction can always run: replaying the programs cannot deadlock with
  rendezvous send/recv, whatever the real costs. `simulate` checks this again. Blocking does cost
  time when stages' instructions do not line up: run with the costs they were built for, GPipe,
  1F1B and ZB-H1 reach their bubble formulas exactly, and interleaved does when a chunk's full
  backward takes t_F/2, t_F or 2 t_F (for ratios 1.5 to 4 it idles up to about 1.5x Megatron's
  non-blocking figure).
* Interleaving (v chunks per stage): chunk c of stage s is virtual stage c*p + s; stage p-1's
  chunk c sends its activations to stage 0's chunk c+1 (wrap-around) and grads flow back.

Schedules (`get_schedule(name, ...)` returns all stages' programs):

* ``gpipe``: all forwards, then all backwards. Activations alive: m per stage.
* ``1f1b``: p-s-1 warm-up forwards on stage s, then one forward / one backward (PipeDream-Flush,
  Megatron). Activations alive: min(p-s, m). Bubble (p-1)(t_f+t_b) like GPipe.
* ``interleaved``: Megatron's interleaved 1F1B with v = `chunks` >= 2 model chunks per stage; needs
  p >= 2 and m a multiple of p (Megatron's grouping of p micro-batches per chunk; m < p is an
  error). Bubble (p-1)(t_f+t_b)/v for whole-stage costs t_f, t_b.
* ``zb-h1``: zero bubble H1 (Qi et al., ICLR 2024): backward split into B (input grad) and W
  (weight grad). The F/B order is 1F1B's; stage s runs W(j) right after B(j+s), so it holds at
  most p-s micro-batches between F and B (1F1B's bound) and p between F and W (1F1B's stage-0
  peak; a pending W keeps less than a full activation). The deferred W passes fill the cooldown:
  with m >= p every stage idles exactly (p-1)(t_F+t_B-t_W) (built for those costs), a third of
  1F1B's (p-1)(t_F+t_B+t_W) when t_F = t_B = t_W; with m < p and unit costs it idles (2p-1-m),
  still less than 1F1B.
"""
from __future__ import annotations

import functools
import os
from fractions import Fraction
from typing import Sequence

from megazero.core.csv_schedule import parse_csv
from megazero.core.instructions import (
    BACKWARD_INPUT, COMPUTE, Backward, BackwardInput, BackwardWeight, Forward, Instruction, LoadMicroBatch,
    OptimizerStep, RecvAct, RecvGrad, ReduceGrads, ScheduleError, SendAct, SendGrad, check_orders,
    stage_and_chunk, virtual_stage,
)
from megazero.core.simulate import Costs, DeadlockError, simulate
from megazero.core.suggest import closest

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
"""Built-in schedule names; `get_schedule` also takes the path of a ``.csv`` schedule."""


# -- compute orders ----------------------------------------------------------------------------------

def _gpipe_order(p: int, m: int, stage: int) -> list[Instruction]:
    return [Forward(mb) for mb in range(m)] + [Backward(mb) for mb in range(m)]


def _one_f_one_b_order(p: int, m: int, stage: int) -> list[Instruction]:
    warmup = min(p - stage - 1, m)
    order: list[Instruction] = [Forward(mb) for mb in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        order += [Forward(warmup + i), Backward(i)]
    return order + [Backward(mb) for mb in range(m - warmup, m)]


def _interleaved_item(k: int, p: int, v: int, backward: bool) -> tuple[int, int]:
    """(mb, chunk) of the k-th forward (or backward) on a stage: groups of p micro-batches per chunk."""
    group, in_group = divmod(k, p * v)
    chunk = in_group // p
    return group * p + in_group % p, (v - 1 - chunk) if backward else chunk


def _interleaved_order(p: int, m: int, stage: int, v: int) -> list[Instruction]:
    total = m * v
    forwards = [Forward(*_interleaved_item(k, p, v, False)) for k in range(total)]
    backwards = [Backward(*_interleaved_item(k, p, v, True)) for k in range(total)]
    warmup = min((p - stage - 1) * 2 + (v - 1) * p, total)  # Megatron's warm-up count
    order = forwards[:warmup]
    for i in range(total - warmup):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[total - warmup:]


def _zb_h1_order(p: int, m: int, stage: int) -> list[Instruction]:
    """1F1B's F/B order with B input-grad only; stage s defers W(j) until right after B(j + s)."""
    order: list[Instruction] = []
    for ins in _one_f_one_b_order(p, m, stage):
        if isinstance(ins, Forward):
            order.append(ins)
            continue
        order.append(BackwardInput(ins.mb))
        if ins.mb >= stage:
            order.append(BackwardWeight(ins.mb - stage))
    return order + [BackwardWeight(mb) for mb in range(max(0, m - stage), m)]


# -- lowering: compute orders -> programs ------------------------------------------------------------

class _Recorder:
    """Runs compute orders in simulated time with blocking transfers; records each stage's program.

    A transfer happens as soon as its tensor exists and both stages are between instructions (idle
    or just finished one); a stage whose next instruction has its input starts it at once rather than
    waiting to send. Every recorded program is thus sorted by one clock, both ends of a transfer sit
    at the same instant, and simultaneous transfers are listed in one global order on every stage.
    """

    def __init__(self, orders: Sequence[Sequence[Instruction]], costs: Costs) -> None:
        self.orders, self.p, self.costs = orders, len(orders), costs
        _, v = check_orders(orders)
        self.last = self.p * v - 1
        self.programs: list[list[Instruction]] = [[] for _ in orders]
        self.pcs = [0] * self.p
        self.running: list[tuple[Fraction, Instruction] | None] = [None] * self.p
        self.pending: dict[tuple[int, int, int], tuple[int, int, Instruction, Instruction]] = {}
        self.arrived: set[tuple[int, str, int, int]] = set()  # (stage, "F"/"B", mb, vstage) inputs at hand

    def finish(self, now: Fraction) -> None:
        """Complete the instructions ending by `now`; their outputs become pending transfers."""
        for s, run in enumerate(self.running):
            if run is None or run[0] > now:
                continue
            self.running[s], ins = None, run[1]
            vs = virtual_stage(s, ins.chunk, self.p)
            if isinstance(ins, Forward) and vs < self.last:
                dst, dst_chunk = stage_and_chunk(vs + 1, self.p)
                self.pending[(0, vs, ins.mb)] = (s, dst, SendAct(ins.mb, ins.chunk, dst),
                                                 RecvAct(ins.mb, dst_chunk, s))
            if isinstance(ins, BACKWARD_INPUT) and vs > 0:
                dst, dst_chunk = stage_and_chunk(vs - 1, self.p)
                self.pending[(1, vs, ins.mb)] = (s, dst, SendGrad(ins.mb, ins.chunk, dst),
                                                 RecvGrad(ins.mb, dst_chunk, s))

    def transfer(self) -> None:
        """Every pending transfer whose two stages are both between instructions happens now."""
        for key in sorted(self.pending):
            src, dst, send, recv = self.pending[key]
            if self.running[src] is None and self.running[dst] is None:
                self.programs[src].append(send)
                self.programs[dst].append(recv)
                kind, vs, mb = key
                self.arrived.add((dst, "F", mb, vs + 1) if kind == 0 else (dst, "B", mb, vs - 1))
                del self.pending[key]

    def _needs(self, s: int, ins: Instruction) -> tuple[int, str, int, int] | None:
        vs = virtual_stage(s, ins.chunk, self.p)
        if isinstance(ins, Forward) and vs > 0:
            return (s, "F", ins.mb, vs)
        if isinstance(ins, BACKWARD_INPUT) and vs < self.last:
            return (s, "B", ins.mb, vs)
        return None

    def start(self, now: Fraction) -> None:
        """Each idle stage starts its next compute instruction if its input has arrived."""
        for s, order in enumerate(self.orders):
            if self.running[s] is not None or self.pcs[s] == len(order):
                continue
            ins = order[self.pcs[s]]
            need = self._needs(s, ins)
            if need is not None and need not in self.arrived:
                continue
            if isinstance(ins, Forward) and virtual_stage(s, ins.chunk, self.p) in (0, self.last):
                self.programs[s].append(LoadMicroBatch(ins.mb))
            self.programs[s].append(ins)
            self.pcs[s] += 1
            # exact rational time: stages must meet at the same instant, which float sums can miss
            self.running[s] = (now + Fraction(self.costs(s, ins)).limit_denominator(1 << 20), ins)

    def stuck(self) -> str:
        parts = []
        for s, order in enumerate(self.orders):
            if self.pcs[s] < len(order):
                ins = order[self.pcs[s]]
                what = "activation" if isinstance(ins, Forward) else "output grad"
                parts.append(f"stage {s} at {ins!r} waits for its input {what}")
        return "compute orders cannot run (a cycle: each waits for a result that comes later): " + "; ".join(parts)


def build_programs(orders: Sequence[Sequence[Instruction]], costs: Costs | None = None
                   ) -> tuple[tuple[Instruction, ...], ...]:
    """Complete per-stage compute orders (F/B/W only) into programs that cannot deadlock.

    Adds each transfer (SendAct after the producing F, RecvAct before the consuming F, SendGrad /
    RecvGrad likewise for input grads), LoadMicroBatch before the first and last virtual stage's
    forwards, and ReduceGrads, OptimizerStep at the end, in the order a run with blocking transfers
    and `costs` (default: unit t_F = t_B = t_W, free transfers) produces (see `_Recorder`). The
    result cannot deadlock under any costs; `costs` only tunes when transfers happen.

    Raises:
        ScheduleError: malformed orders (missing work, B before F, ...) or orders with a cycle.
    """
    rec = _Recorder(orders, costs if costs is not None else Costs())
    now = Fraction(0)
    while True:
        rec.finish(now)
        rec.transfer()
        rec.start(now)
        ends = [run[0] for run in rec.running if run is not None]
        if not ends:
            break
        now = min(ends)
    if any(pc < len(order) for pc, order in zip(rec.pcs, orders)):
        raise ScheduleError(rec.stuck())
    return tuple(tuple(program) + (ReduceGrads(), OptimizerStep()) for program in rec.programs)


# -- argument checks and the registry ----------------------------------------------------------------

def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ScheduleError(f"{name}={value!r} must be an integer >= {minimum}")


def check_sizes(name: str, num_stages: int, num_microbatches: int | None, chunks: int) -> None:
    """Raise ScheduleError (with the config key it concerns) unless built-in schedule `name` can run
    p = `num_stages` stages, m = `num_microbatches` (None: not known yet, not checked) and v = `chunks`.
    The config validation calls this too: the rules live here only."""
    _check_int("num_stages", num_stages, 1)
    if num_microbatches is not None:
        _check_int("num_microbatches", num_microbatches, 1)
    _check_int("chunks", chunks, 1)
    if name != "interleaved":
        if chunks != 1:
            raise ScheduleError(f"chunks={chunks} (pipeline.chunks) only applies to the 'interleaved' schedule; "
                                f"{name!r} runs one chunk per stage (chunks=1)", key="pipeline.chunks")
        return
    if chunks < 2:
        raise ScheduleError(f"the 'interleaved' schedule needs chunks >= 2 (pipeline.chunks), got {chunks}; "
                            f"with one chunk per stage use '1f1b'", key="pipeline.chunks")
    if num_stages < 2:
        raise ScheduleError("the 'interleaved' schedule needs num_stages >= 2 (parallel.pp); with one stage use "
                            "'1f1b'")
    if num_microbatches is None:
        return
    if num_microbatches < num_stages:
        raise ScheduleError(f"the 'interleaved' schedule needs num_microbatches (train.gradient_accumulation_steps) "
                            f">= num_stages (parallel.pp), got "
                            f"m={num_microbatches} < p={num_stages}", key="train.gradient_accumulation_steps")
    if num_microbatches % num_stages:
        lower = num_microbatches - num_microbatches % num_stages
        raise ScheduleError(f"the 'interleaved' schedule needs num_microbatches (train.gradient_accumulation_steps) "
                            f"to be a multiple of num_stages (parallel.pp): it runs groups of p micro-batches per "
                            f"chunk, as Megatron; got "
                            f"m={num_microbatches}, p={num_stages}; use m={lower} or m={lower + num_stages}",
                            key="train.gradient_accumulation_steps")


def _check_stage(stage: int, num_stages: int) -> None:
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ScheduleError(f"stage={stage!r} must be an integer in 0..{num_stages - 1} (num_stages={num_stages})")


@functools.lru_cache(maxsize=256)
def _programs(name: str, p: int, m: int, v: int, costs: Costs | None) -> tuple[tuple[Instruction, ...], ...]:
    if name == "gpipe":
        orders = [_gpipe_order(p, m, s) for s in range(p)]
    elif name == "1f1b":
        orders = [_one_f_one_b_order(p, m, s) for s in range(p)]
    elif name == "interleaved":
        orders = [_interleaved_order(p, m, s, v) for s in range(p)]
    else:
        orders = [_zb_h1_order(p, m, s) for s in range(p)]
    return build_programs(orders, costs)


def _one_stage(name: str, num_stages: int, num_microbatches: int, stage: int, chunks: int, costs: Costs | None):
    check_sizes(name, num_stages, num_microbatches, chunks)
    _check_stage(stage, num_stages)
    return _programs(name, num_stages, num_microbatches, chunks, costs)[stage]


def gpipe(num_stages: int, num_microbatches: int, stage: int, costs: Costs | None = None) -> tuple[Instruction, ...]:
    """Stage `stage`'s GPipe program: all forwards, then all backwards, then reduce and step.
    `costs` (default unit) are the costs the transfer order is tuned for (see `build_programs`)."""
    return _one_stage("gpipe", num_stages, num_microbatches, stage, 1, costs)


def one_f_one_b(num_stages: int, num_microbatches: int, stage: int, costs: Costs | None = None
                ) -> tuple[Instruction, ...]:
    """Stage `stage`'s 1F1B (PipeDream-Flush) program."""
    return _one_stage("1f1b", num_stages, num_microbatches, stage, 1, costs)


def interleaved_1f1b(num_stages: int, num_microbatches: int, stage: int, chunks: int, costs: Costs | None = None
                     ) -> tuple[Instruction, ...]:
    """Stage `stage`'s interleaved 1F1B program with `chunks` model chunks per stage."""
    return _one_stage("interleaved", num_stages, num_microbatches, stage, chunks, costs)


def zb_h1(num_stages: int, num_microbatches: int, stage: int, costs: Costs | None = None) -> tuple[Instruction, ...]:
    """Stage `stage`'s zero-bubble ZB-H1 program (B and W split, W deferred into the bubble)."""
    return _one_stage("zb-h1", num_stages, num_microbatches, stage, 1, costs)


def get_schedule(name: str, num_stages: int, num_microbatches: int, chunks: int = 1, costs: Costs | None = None
                 ) -> tuple[tuple[Instruction, ...], ...]:
    """All stages' programs of schedule `name` (one of `SCHEDULES`, or the path of a ``.csv``).

    A CSV schedule must have exactly `num_stages` stages, `num_microbatches` micro-batches and
    `chunks` chunks per stage (see `csv_schedule` for the format). `costs` (default: unit
    t_F = t_B = t_W) are the per-chunk costs the order of the blocking transfers is tuned for;
    any order built here is deadlock-free whatever the real costs.
    """
    if isinstance(name, (str, os.PathLike)) and os.fspath(name).endswith(".csv"):
        programs = load_csv(name, costs)
        _check_int("num_stages", num_stages, 1)
        m = 1 + max(ins.mb for ins in programs[0] if isinstance(ins, COMPUTE))
        v = 1 + max(ins.chunk for ins in programs[0] if isinstance(ins, COMPUTE))
        for arg, want, got in (("num_stages", num_stages, len(programs)), ("num_microbatches", num_microbatches, m),
                               ("chunks", chunks, v)):
            if want != got:
                raise ScheduleError(f"schedule file {os.fspath(name)!r} has {arg}={got}, "
                                    f"but {arg}={want} was asked for")
        return programs
    if name not in SCHEDULES:
        close = closest(str(name), SCHEDULES)
        hint = f"did you mean {close!r}? " if close else ""
        raise ScheduleError(f"unknown pipeline schedule {name!r} (pipeline.schedule); {hint}valid schedules are "
                            f"{', '.join(SCHEDULES)}, or the path of a .csv schedule")
    check_sizes(name, num_stages, num_microbatches, chunks)
    return _programs(name, num_stages, num_microbatches, chunks, costs)


def bubble_fraction(name: str, num_stages: int, num_microbatches: int, chunks: int = 1,
                    costs: Costs | None = None) -> float:
    """The idle fraction of one step of schedule `name`, as the simulator measures it (idle / (work
    + idle), unit costs by default). With m >= p it equals the closed forms of docs/reference.md:
    (p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(v·m+p-1) interleaved, (p-1)/(3m+p-1) zb-h1."""
    return simulate(get_schedule(name, num_stages, num_microbatches, chunks, costs), costs).bubble_fraction


def with_loads_everywhere(program: Sequence[Instruction]) -> tuple[Instruction, ...]:
    """`program` loading each micro-batch right before its first Forward here (once: a later load of it, the
    last virtual stage's, is dropped), for a model whose every stage reads the micro-batch (packed documents:
    the layers follow its documents). A stage's first forwards run in micro-batch order in every schedule, so
    the loads still pull the data iterator in order."""
    seen: set[int] = set()
    out: list[Instruction] = []
    for ins in program:
        if isinstance(ins, LoadMicroBatch):
            if ins.mb not in seen:
                seen.add(ins.mb)
                out.append(ins)
            continue
        if isinstance(ins, Forward) and ins.mb not in seen:
            seen.add(ins.mb)
            out.append(LoadMicroBatch(ins.mb))
        out.append(ins)
    return tuple(out)


def splits_backward(programs: Sequence[Sequence[Instruction]]) -> bool:
    """Whether the programs run backward as separate B (input grad) and W (weight grad)."""
    return any(isinstance(ins, BackwardWeight) for program in programs for ins in program)


def forward_only(num_stages: int, num_microbatches: int, stage: int, chunks: int = 1) -> tuple[Instruction, ...]:
    """Evaluation program of `stage`: each micro-batch passes through every virtual stage in turn
    (forward only, activations sent downstream; no ReduceGrads, no OptimizerStep). One micro-batch
    is in flight at a time, so blocking p2p cannot deadlock."""
    for arg, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches), ("chunks", chunks)):
        _check_int(arg, value, 1)
    _check_stage(stage, num_stages)
    last = num_stages * chunks - 1
    program: list[Instruction] = []
    for mb in range(num_microbatches):
        if stage == 0 or stage == last % num_stages:
            program.append(LoadMicroBatch(mb))
        for c in range(chunks):
            vs = virtual_stage(stage, c, num_stages)
            if vs > 0:
                program.append(RecvAct(mb, c, (stage - 1) % num_stages))
            program.append(Forward(mb, c))
            if vs < last:
                program.append(SendAct(mb, c, (stage + 1) % num_stages))
    return tuple(program)


def from_csv(text: str, costs: Costs | None = None) -> tuple[tuple[Instruction, ...], ...]:
    """Programs from CSV text: compute-only rows are completed by `build_programs` (tuned for
    `costs`), explicit rows taken as they are. Either way the result is checked by `simulate`
    (structure, pairing, deadlock)."""
    rows, explicit = parse_csv(text)
    programs = rows if explicit else build_programs(rows, costs)
    simulate(programs)
    return programs


def load_csv(path: str | os.PathLike, costs: Costs | None = None) -> tuple[tuple[Instruction, ...], ...]:
    """`from_csv` on the contents of `path`; errors name the file."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise ScheduleError(f"cannot read pipeline schedule file {os.fspath(path)!r}: {exc.strerror}") from exc
    try:
        return from_csv(text, costs)
    except DeadlockError as exc:
        raise DeadlockError(f"{os.fspath(path)}: {exc}", exc.positions) from None
    except ScheduleError as exc:
        raise ScheduleError(f"{os.fspath(path)}: {exc}") from None


__all__ = [
    "SCHEDULES", "bubble_fraction", "build_programs", "check_sizes", "forward_only", "from_csv", "get_schedule", "gpipe",
    "interleaved_1f1b", "load_csv", "one_f_one_b", "splits_backward", "zb_h1",
]
