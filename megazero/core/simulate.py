"""Run every stage's pipeline program against the others, in simulated time (pure, no torch).

With ``batched=True`` p2p is megazero's NCCL path instead: non-blocking runs of transfers (`_run_batched`).

`simulate(programs, costs)` executes the programs with the same semantics as the executor:
each stage runs its instructions in order; a send and its receive are a *rendezvous* (neither
completes before both are posted, as blocking p2p on gloo), paired first-in first-out per
(sender, receiver). A program set the simulator accepts therefore cannot deadlock with blocking
send/recv, and one it rejects would hang (`DeadlockError`) or pair the wrong tensors
(`ScheduleError`).

Accounting (all per stage, in the units of `Costs`):

* busy = time in compute instructions (F, B, W, loads, ReduceGrads, OptimizerStep);
* idle = makespan - busy: waiting for peers plus time in transfers (the pipeline bubble);
* bubble_fraction = total idle / (stages x makespan); bubble_over_ideal = total idle / total busy.
  For GPipe and 1F1B with zero-cost p2p these are (p-1)/(m+p-1) and (p-1)/m (docs/reference.md);
* peak_inflight = most micro-batch chunks whose Forward ran and whose input grad (Backward or
  BackwardInput) had not finished: the activations 1F1B's memory bound is about;
* peak_unfinished = most micro-batch chunks whose Forward ran and whose weight grads (Backward or
  BackwardWeight) had not finished. For zero-bubble schedules the chunks between B and W still
  hold the layer inputs and output grads that W needs; without split backwards it equals peak_inflight.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence, Union

from megazero.core.instructions import (
    BACKWARD_INPUT, P2P, SENDS, Backward, BackwardInput, BackwardWeight, Forward, Instruction, LoadMicroBatch,
    OptimizerStep, RecvAct, RecvGrad, ReduceGrads, ScheduleError, SendAct, check_programs, p2p_runs, virtual_stage,
)


@dataclass(frozen=True)
class Costs:
    """Duration of each kind of instruction. A full `Backward` costs backward_input + backward_weight;
    `p2p` is the duration of one matched send/receive (both stages are held for it)."""

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    p2p: float = 0.0
    load: float = 0.0
    reduce_grads: float = 0.0
    optimizer_step: float = 0.0

    def __call__(self, stage: int, ins: Instruction) -> float:
        """Duration of `ins` on `stage` (the same on every stage)."""
        if isinstance(ins, Forward):
            return self.forward
        if isinstance(ins, Backward):
            return self.backward_input + self.backward_weight
        if isinstance(ins, BackwardInput):
            return self.backward_input
        if isinstance(ins, BackwardWeight):
            return self.backward_weight
        if isinstance(ins, P2P):
            return self.p2p
        if isinstance(ins, LoadMicroBatch):
            return self.load
        if isinstance(ins, ReduceGrads):
            return self.reduce_grads
        if isinstance(ins, OptimizerStep):
            return self.optimizer_step
        raise ScheduleError(f"no cost for instruction {ins!r} of type {type(ins).__name__}")


CostFn = Callable[[int, Instruction], float]
"""Any `(stage, instruction) -> duration`; `Costs` is one."""


class DeadlockError(ScheduleError):
    """Every unfinished stage waits on a peer. `positions[s]` is (0-based index, instruction) of stage
    s's blocked instruction, or None for a stage that finished."""

    def __init__(self, message: str, positions: tuple[tuple[int, Instruction] | None, ...]) -> None:
        super().__init__(message)
        self.positions = positions


class Span(NamedTuple):
    """One executed instruction: [start, end) in simulated time."""

    start: float
    end: float
    instr: Instruction


class Message(NamedTuple):
    """One matched transfer: the send at timeline[src][src_index], the receive at timeline[dst][dst_index]."""

    src: int
    src_index: int
    dst: int
    dst_index: int


@dataclass(frozen=True)
class SimResult:
    """What `simulate` measured; see the module docstring for the definitions."""

    timeline: tuple[tuple[Span, ...], ...]
    messages: tuple[Message, ...]
    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    peak_inflight: tuple[int, ...]
    peak_unfinished: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.timeline)

    @property
    def bubble_fraction(self) -> float:
        """Idle time over the total step time, averaged over stages."""
        return sum(self.idle) / (self.num_stages * self.makespan) if self.makespan else 0.0

    @property
    def bubble_over_ideal(self) -> float:
        """Idle time over compute time (the bubble relative to an ideal, bubble-free step)."""
        busy = sum(self.busy)
        return sum(self.idle) / busy if busy else 0.0

    def critical_path(self) -> list[tuple[int, Span]]:
        """The chain of (stage, span) that determines the makespan: each starts when the previous ends."""
        import networkx as nx  # lazy: only the critical path needs it

        sink = (-1, -1)  # after every stage's last instruction
        graph = nx.DiGraph()
        for s, spans in enumerate(self.timeline):
            for i in range(1, len(spans)):
                graph.add_edge((s, i - 1), (s, i), weight=_duration(spans[i - 1]))
            if spans:
                graph.add_edge((s, len(spans) - 1), sink, weight=_duration(spans[-1]))
        for msg in self.messages:  # a rendezvous starts after both sides' previous instructions
            for (a, ia), (b, ib) in (((msg.src, msg.src_index), (msg.dst, msg.dst_index)),
                                     ((msg.dst, msg.dst_index), (msg.src, msg.src_index))):
                if ia > 0:
                    graph.add_edge((a, ia - 1), (b, ib), weight=_duration(self.timeline[a][ia - 1]))
        path = nx.dag_longest_path(graph, weight="weight")
        return [(s, self.timeline[s][i]) for s, i in path if (s, i) != sink]


def _duration(span: Span) -> float:
    return span.end - span.start


def _counterpart(send: Instruction) -> type:
    return RecvAct if isinstance(send, SendAct) else RecvGrad


def _check_pair(send_stage: int, send: Instruction, recv_stage: int, recv: Instruction, num_stages: int) -> None:
    """The two heads of one FIFO link are about to pair: they must describe the same tensor."""
    step = 1 if isinstance(send, SendAct) else -1
    sent_v = virtual_stage(send_stage, send.chunk, num_stages)
    recv_v = virtual_stage(recv_stage, recv.chunk, num_stages)
    if not isinstance(recv, _counterpart(send)) or send.mb != recv.mb or recv_v != sent_v + step:
        raise ScheduleError(
            f"mismatched transfer: stage {send_stage}'s {send.describe()} would be received by "
            f"stage {recv_stage}'s {recv.describe()}; the k-th send from a stage to a peer pairs with "
            f"the k-th receive at that peer, so both programs must list the transfers in the same order"
        )


def _deadlock(programs: Sequence[Sequence[Instruction]], pcs: list[int]) -> DeadlockError:
    positions, parts = [], []
    for s, program in enumerate(programs):
        if pcs[s] >= len(program):
            positions.append(None)
            parts.append(f"stage {s} finished")
        else:
            positions.append((pcs[s], program[pcs[s]]))
            parts.append(f"stage {s} blocked at {program[pcs[s]].describe()} "
                         f"(instruction {pcs[s] + 1} of {len(program)})")
    return DeadlockError("deadlock with blocking send/recv: " + "; ".join(parts), tuple(positions))


def _run(programs: Sequence[Sequence[Instruction]], cost: CostFn):
    """Execute with rendezvous p2p; returns per-stage spans and the matched messages."""
    p = len(programs)
    pcs, clock = [0] * p, [0.0] * p
    spans: list[list[Span]] = [[] for _ in range(p)]
    messages: list[Message] = []
    remaining = sum(len(prog) for prog in programs)
    while remaining:
        progress = False
        for s in range(p):
            while pcs[s] < len(programs[s]):
                ins = programs[s][pcs[s]]
                if not isinstance(ins, P2P):
                    end = clock[s] + cost(s, ins)
                    spans[s].append(Span(clock[s], end, ins))
                    clock[s], pcs[s], remaining, progress = end, pcs[s] + 1, remaining - 1, True
                    continue
                q = ins.peer
                if not 0 <= q < p or q == s:
                    raise ScheduleError(f"stage {s}: {ins.describe()} names no other stage (stages are 0..{p - 1})")
                other = programs[q][pcs[q]] if pcs[q] < len(programs[q]) else None
                if not isinstance(other, P2P) or other.peer != s or isinstance(other, SENDS) == isinstance(ins, SENDS):
                    break  # the peer is not (yet) at the other end of this link
                is_send = isinstance(ins, SENDS)
                send_stage, send, recv_stage, recv = (s, ins, q, other) if is_send else (q, other, s, ins)
                _check_pair(send_stage, send, recv_stage, recv, p)
                start = max(clock[s], clock[q])
                end = start + cost(send_stage, send)
                messages.append(Message(send_stage, len(spans[send_stage]), recv_stage, len(spans[recv_stage])))
                for stage, instr in ((send_stage, send), (recv_stage, recv)):
                    spans[stage].append(Span(start, end, instr))
                    clock[stage], pcs[stage] = end, pcs[stage] + 1
                remaining, progress = remaining - 2, True
        if not progress:
            raise _deadlock(programs, pcs)
    return spans, messages


def _run_batched(programs: Sequence[Sequence[Instruction]], cost: CostFn):
    """Execute with batched, non-blocking p2p (megazero's NCCL path, `megazero.pipeline.p2p`): each maximal
    run of consecutive p2p instructions of a stage is posted at once when the stage reaches it; the k-th
    send from a stage to a peer pairs with the k-th receive there; a transfer starts once both ends are
    posted and the previous transfer in that direction of that link is done, and lasts the send's cost;
    the stage resumes when every transfer of its run is done. Returns per-stage spans (each transfer from
    its start to its end; a run's may overlap; the wait before a start is idle) and the matched messages."""
    p = len(programs)
    pcs, clock = [0] * p, [0.0] * p
    spans: list[list[Span]] = [[] for _ in range(p)]
    posted: dict = {}  # (src, dst, "send" | "recv") -> [(post time, stage, instruction)]
    ends: dict = {}  # (src, dst) -> [end time of the k-th transfer]
    runs = {s: dict(_runs_of(programs[s])) for s in range(p)}
    waiting: list = [None] * p  # the run a stage has posted and waits on: [(link, kind, k, instruction)]
    placed: dict = {}  # (src, dst, k) -> {"send": span index, "recv": span index}
    remaining = sum(len(prog) for prog in programs)
    while remaining:
        progress = False
        for s in range(p):
            while pcs[s] < len(programs[s]):
                ins = programs[s][pcs[s]]
                if not isinstance(ins, P2P):
                    end = clock[s] + cost(s, ins)
                    spans[s].append(Span(clock[s], end, ins))
                    clock[s], pcs[s], remaining, progress = end, pcs[s] + 1, remaining - 1, True
                    continue
                if waiting[s] is None:  # post the whole run now
                    ops = []
                    for op in programs[s][pcs[s]:runs[s][pcs[s]]]:
                        q = op.peer
                        if not 0 <= q < p or q == s:
                            raise ScheduleError(f"stage {s}: {op.describe()} names no other stage (stages are "
                                                f"0..{p - 1})")
                        link, kind = ((s, q), "send") if isinstance(op, SENDS) else ((q, s), "recv")
                        queue = posted.setdefault((*link, kind), [])
                        queue.append((clock[s], s, op))
                        ops.append((link, kind, len(queue) - 1, op))
                    waiting[s], progress = ops, True
                ops = waiting[s]
                if not all(len(posted.get((*link, "recv" if kind == "send" else "send"), ())) > k
                           for link, kind, k, _ in ops):
                    break  # a peer has not posted its end of one of these transfers yet
                run_end = clock[s]
                for link, kind, k, op in ops:
                    start, end = _transfer(link, k, posted, ends, cost, p)
                    placed.setdefault((*link, k), {})[kind] = len(spans[s])
                    spans[s].append(Span(start, end, op))
                    run_end = max(run_end, end)
                remaining, pcs[s], clock[s], waiting[s], progress = (remaining - len(ops), pcs[s] + len(ops),
                                                                     run_end, None, True)
        if not progress:
            raise _deadlock(programs, pcs)
    messages = [Message(src, idx["send"], dst, idx["recv"]) for (src, dst, _), idx in sorted(placed.items())]
    return spans, messages


def _runs_of(program: Sequence[Instruction]):
    """(start, stop) of each run of consecutive p2p instructions, keyed by start."""
    return p2p_runs(program)


def _transfer(link, k: int, posted: dict, ends: dict, cost: CostFn, num_stages: int) -> tuple[float, float]:
    """(start, end) of the k-th transfer over `link` (src, dst), the earlier ones computed first (they go in
    order): it starts when both ends are posted and the previous one is done."""
    done = ends.setdefault(link, [])
    while len(done) <= k:
        i = len(done)
        (t_send, src, send), (t_recv, dst, recv) = posted[(*link, "send")][i], posted[(*link, "recv")][i]
        _check_pair(src, send, dst, recv, num_stages)
        start = max(t_send, t_recv, done[-1][1] if done else 0.0)
        done.append((start, start + cost(src, send)))
    return done[k]


def peaks(program: Sequence[Instruction]) -> tuple[int, int]:
    """(peak in-flight, peak unfinished) micro-batch chunks of one stage's program (see the module
    docstring). 1F1B stage s of p: min(p - s, m) in flight; GPipe: m. The engine sizes the
    contiguous activation-checkpoint buffer with the first."""
    inflight = unfinished = peak_inflight = peak_unfinished = 0
    for ins in program:
        if isinstance(ins, Forward):
            inflight, unfinished = inflight + 1, unfinished + 1
            peak_inflight, peak_unfinished = max(peak_inflight, inflight), max(peak_unfinished, unfinished)
        elif isinstance(ins, BACKWARD_INPUT):
            inflight -= 1
        if isinstance(ins, (Backward, BackwardWeight)):
            unfinished -= 1
    return peak_inflight, peak_unfinished


def simulate(programs: Sequence[Sequence[Instruction]], costs: Union[Costs, CostFn, None] = None,
             check: bool = True, batched: bool = False) -> SimResult:
    """Run all stages' programs together (stage s is ``programs[s]``) with blocking p2p, or with `batched`
    non-blocking p2p as megazero runs it on NCCL (`_run_batched`; the planner predicts GPU runs with it).

    Args:
        programs: one program per pipeline stage, e.g. from `schedules.get_schedule`.
        costs: a `Costs` (default: unit F, B and W, free p2p) or any ``(stage, instr) -> duration``.
        check: first validate each program's structure (every chunk's F before B before W, receives
            before use, sends after production, peers right, ends in ReduceGrads, OptimizerStep).

    Raises:
        ScheduleError: a structural problem, or a send that would pair with the wrong receive.
        DeadlockError: the programs hang; the message names every stage's blocked instruction.
    """
    if not programs:
        raise ScheduleError("simulate needs at least one stage's program")
    if check:
        check_programs(programs)
    cost = costs if costs is not None else Costs()
    spans, messages = (_run_batched if batched else _run)(programs, cost)
    makespan = max((st[-1].end for st in spans if st), default=0.0)
    busy = tuple(sum(sp.end - sp.start for sp in st if not isinstance(sp.instr, P2P)) for st in spans)
    stage_peaks = [peaks(prog) for prog in programs]
    return SimResult(
        timeline=tuple(tuple(st) for st in spans),
        messages=tuple(messages),
        makespan=makespan,
        busy=busy,
        idle=tuple(makespan - b for b in busy),
        peak_inflight=tuple(pk[0] for pk in stage_peaks),
        peak_unfinished=tuple(pk[1] for pk in stage_peaks),
    )


__all__ = ["Costs", "CostFn", "DeadlockError", "Message", "SimResult", "Span", "peaks", "simulate"]
