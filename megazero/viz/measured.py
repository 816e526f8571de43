"""A run's measured step as a `Timeline`, and the simulator's costs measured in it (pure: json only).

The trainer with ``trace.enabled=true`` writes ``<run_dir>/trace/rank<r>.json`` (`megazero.run.trace`):
one Chrome-trace event per executed instruction with its step, micro-batch, chunk and peer, and
per rank its grid coordinates and the Unix time of its clock's origin. `MeasuredStep.load` reads one
step of one rank per pipeline stage (by default dp rank 0, tp rank 0) and puts all of them on one time
axis in milliseconds from the step's first instruction on any of those ranks:

* compute blocks are the F / B / W events (and loads, gradient reductions, optimizer steps);
* transfers are the send and receive events. A blocking receive lasts from the moment the stage asks
  for the tensor until it has it, so on a measured row a transfer is mostly *waiting* for the peer:
  it is drawn as a p2p bar, never as compute;
* busy = time in non-p2p instructions; idle = makespan - busy (waits and transfers); bubble = idle /
  makespan, the simulator's definitions; peak in flight comes from the executed order
  (`megazero.core.simulate.peaks`), and its bytes from the rank's first-step activation meter.

`MeasuredStep.costs()` is a cost function for `simulate`: each (stage, kind, chunk)'s mean measured
duration, and per pipeline link the fastest transfer measured on it (the transfer without waiting);
`MeasuredStep.programs` are the programs the ranks executed. Simulating one with the other is the
*plan* of that step: what the schedule promises when every instruction takes its measured time.
"""
from __future__ import annotations

import glob
import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass

from megazero.core import instructions as I
from megazero.core.simulate import peaks
from megazero.viz.timeline import STEP_KINDS, Block, StageSummary, Timeline, block_of

_NAME = re.compile(r"^[A-Z]+?(\d+)(?:c(\d+))?(?:[<>](\d+))?$")


def _ranges(steps: list[int]) -> str:
    """``1..4, 7`` for [1, 2, 3, 4, 7]."""
    out, start = [], steps[0]
    for a, b in zip(steps, steps[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}..{a}" if a != start else f"{a}")
            start = b
    return ", ".join(out)


class TraceError(ValueError):
    """A run directory without usable traces; the message is one line that says what to do."""


def trace_files(path: str, option: str = "--run") -> list[str]:
    """The ``rank<r>.json`` files of a run directory (or of its ``trace/`` directory), by rank;
    `option` names the command-line option in the error."""
    if not os.path.isdir(path):
        raise TraceError(f"{option} {path!r}: no such directory")
    folder = os.path.join(path, "trace") if os.path.isdir(os.path.join(path, "trace")) else path
    files = glob.glob(os.path.join(folder, "rank*.json"))
    files = [f for f in files if re.fullmatch(r"rank\d+\.json", os.path.basename(f))]
    if not files:
        raise TraceError(f"{option} {path!r}: no trace/rank*.json; run the trainer with trace.enabled=true")
    return sorted(files, key=lambda f: int(os.path.basename(f)[4:-5]))


def _instruction(event: dict):
    """The instruction an event recorded (its class is the event's category)."""
    cls = getattr(I, event.get("cat", ""), None)
    if cls in (I.ReduceGrads, I.OptimizerStep):
        return cls()
    args = event.get("args", {})
    match = _NAME.match(event["name"])
    if cls is None or match is None:
        raise TraceError(f"trace event {event['name']!r} ({event.get('cat')!r}) is not a pipeline instruction")
    mb = int(args["mb"]) if args.get("mb") is not None else int(match.group(1))
    if cls is I.LoadMicroBatch:
        return cls(mb)
    chunk = int(args.get("chunk", match.group(2) or 0))
    if issubclass(cls, I.P2P):
        return cls(mb, chunk, int(args.get("peer", match.group(3))))
    return cls(mb, chunk)


@dataclass(frozen=True)
class MeasuredStep:
    """One step of one rank per pipeline stage: `spans[s]` are (instruction, start ms, end ms) in the
    executed order, on one axis that starts at the step's first instruction. `ranks[s]` is the global
    rank drawn for stage s; `peak_bytes[s]` its measured peak activation bytes (None: not recorded)."""

    step: int
    ranks: tuple[int, ...]
    spans: tuple[tuple[tuple[object, float, float], ...], ...]
    peak_bytes: tuple[int | None, ...]
    aligned: bool

    @classmethod
    def load(cls, path: str, step: int | None = None, dp_rank: int = 0, tp_rank: int = 0) -> "MeasuredStep":
        """Read `step` (default: the last one traced) of the ranks at (`dp_rank`, `tp_rank`) of every
        stage from the traces under run directory `path`."""
        chosen: dict[int, dict] = {}
        names: dict[int, str] = {}
        worlds: set = set()
        for f in trace_files(path):
            try:
                with open(f) as handle:
                    trace = json.load(handle)
                meta = trace["metadata"]
                stage, events = int(meta["stage"]), trace["traceEvents"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{f}: not a megazero trace ({type(exc).__name__}: {exc})") from None
            worlds.add(meta.get("world_size"))
            if meta.get("dp_rank") == dp_rank and meta.get("tp_rank") == tp_rank:
                if stage in chosen:
                    raise TraceError(f"{f} and {names[stage]} both trace stage {stage} at dp rank {dp_rank}, tp rank "
                                     f"{tp_rank}: traces of two runs are mixed; keep one run's trace/ folder")
                chosen[stage], names[stage] = trace, f
        if len(worlds - {None}) > 1:
            raise TraceError(f"--run {path!r}: traces of runs with world sizes {sorted(worlds - {None})} are mixed; "
                             f"keep one run's trace/ folder")
        if not chosen:
            raise TraceError(f"--run {path!r}: no rank at dp rank {dp_rank}, tp rank {tp_rank}")
        stages = sorted(chosen)
        if stages != list(range(len(stages))):
            raise TraceError(f"--run {path!r}: traces of pipeline stages {stages} at dp rank {dp_rank}, tp rank "
                             f"{tp_rank}; every stage 0..{max(stages)} is needed")
        traces = [chosen[s] for s in stages]
        events = [[e for e in t["traceEvents"] if e.get("ph") == "X"] for t in traces]
        per_rank = [{e["args"]["step"] for e in ev} for ev in events]
        steps = set.intersection(*per_rank)
        if not steps:
            raise TraceError(f"--run {path!r}: the traces hold no step that every stage ran")
        step = max(steps) if step is None else step
        if step not in steps:
            lacking = [t["metadata"]["rank"] for t, have in zip(traces, per_rank) if step not in have]
            if len(lacking) < len(traces):
                raise TraceError(f"--step {step}: rank {lacking[0]}'s trace does not hold it; every stage holds "
                                 f"steps {_ranges(sorted(steps))}")
            raise TraceError(f"--step {step}: the traces hold steps {_ranges(sorted(steps))}")
        aligned = all("unix_origin_s" in t["metadata"] for t in traces)
        origin = [t["metadata"].get("unix_origin_s", 0.0) * 1e3 if aligned else 0.0 for t in traces]  # ms
        picked = [[e for e in ev if e["args"]["step"] == step] for ev in events]
        t0 = min(o + e["ts"] / 1e3 for o, ev in zip(origin, picked) for e in ev)
        spans = tuple(tuple((_instruction(e), o + e["ts"] / 1e3 - t0, o + (e["ts"] + e["dur"]) / 1e3 - t0)
                            for e in sorted(ev, key=lambda e: e["ts"])) for o, ev in zip(origin, picked))
        return cls(step, tuple(int(t["metadata"]["rank"]) for t in traces), spans,
                   tuple(t["metadata"].get("peak_activation_bytes") for t in traces), aligned)

    @property
    def programs(self) -> list[list]:
        """The instructions each stage executed, in order (a program set `simulate` accepts)."""
        return [[ins for ins, _, _ in spans] for spans in self.spans]

    def timeline(self, title: str | None = None) -> Timeline:
        """The step as a `Timeline` in ms (source "measured")."""
        makespan = max((end for spans in self.spans for _, _, end in spans), default=0.0)
        if makespan <= 0:
            raise TraceError(f"step {self.step} took no time in the traces (ranks {list(self.ranks)})")
        blocks: list[Block] = []
        transfers: list[Block] = []
        stages = []
        for s, spans in enumerate(self.spans):
            busy = 0.0
            for ins, start, end in spans:
                block = block_of(s, start, end, ins)
                if isinstance(ins, I.P2P):
                    transfers.append(block)
                    continue
                busy += end - start
                if isinstance(ins, I.COMPUTE) or (isinstance(ins, STEP_KINDS) and end > start):
                    blocks.append(block)
            inflight, unfinished = peaks([ins for ins, _, _ in spans])
            stages.append(StageSummary(s, busy, makespan - busy, (makespan - busy) / makespan, inflight, unfinished,
                                       self.peak_bytes[s]))
        bubble = sum(st.idle for st in stages) / (len(stages) * makespan)
        title = title or f"step {self.step} (ranks {', '.join(map(str, self.ranks))})" + (
            "" if self.aligned else "; clocks NOT aligned: traces without unix_origin_s, each rank on its own axis")
        return Timeline(title, len(stages), makespan, bubble, tuple(blocks), tuple(transfers), tuple(stages),
                        "ms", "measured")

    def costs(self) -> "MeasuredCosts":
        """The simulator's cost function with this step's measured durations."""
        sums: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0])
        link: dict[tuple[int, int], float] = {}
        for s, spans in enumerate(self.spans):
            for ins, start, end in spans:
                if isinstance(ins, I.P2P):
                    key = (s, ins.peer) if isinstance(ins, I.SENDS) else (ins.peer, s)
                    link[key] = min(link.get(key, float("inf")), end - start)
                else:
                    total = sums[_cost_key(s, ins)]
                    total[0], total[1] = total[0] + end - start, total[1] + 1
        return MeasuredCosts({k: t / n for k, (t, n) in sums.items()}, link)


def _cost_key(stage: int, ins) -> tuple:
    return (stage, type(ins).__name__, getattr(ins, "chunk", 0))


@dataclass(frozen=True)
class MeasuredCosts:
    """`(stage, instruction) -> ms`: mean measured durations per (stage, kind, chunk); a transfer from
    stage a to b costs the fastest one measured on that link."""

    mean: dict
    link: dict

    def __call__(self, stage: int, ins) -> float:
        if isinstance(ins, I.P2P):
            return self.link[(stage, ins.peer)]  # the simulator asks with the sending stage
        return self.mean.get(_cost_key(stage, ins), 0.0)


__all__ = ["MeasuredCosts", "MeasuredStep", "TraceError", "trace_files"]
