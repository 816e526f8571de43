"""How ``plan.py --calibrate``'s probes time what they measure (`megazero.toolbox.calibrate`,
`megazero.toolbox.step_probe`): medians of repeated samples, sized by the work so that ranks sharing cores compute
together, and kernels timed in turn round after round."""
from __future__ import annotations

import statistics
import time


def median_seconds(fn, repeats: int, sync, sample_s: float = 0.05, calls: int | None = None,
                    clock=time.perf_counter) -> float:
    """The median over `repeats` samples of one call's seconds on `clock` (wall time; `time.process_time`: the
    CPU time this rank used); each sample times `calls` calls (default: enough to last about `sample_s` here).
    Ranks sharing cores pass the same `calls` (sized by the work, not by a timing), so that they compute
    together for the whole measurement."""
    return medians(fn, repeats, sync, sample_s, calls, (clock,))[0]


def medians(fn, repeats: int, sync, sample_s: float, calls: int | None, clocks: tuple) -> list[float]:
    """`median_seconds` on every clock of `clocks` at once (the same samples)."""
    start = clocks[0]()
    fn()
    sync()
    inner = calls or max(1, int(sample_s / max(clocks[0]() - start, 1e-7)))
    times = [[] for _ in clocks]
    for _ in range(repeats):
        starts = [clock() for clock in clocks]
        for _ in range(inner):
            fn()
        sync()
        for t, clock, begun in zip(times, clocks, starts):
            t.append((clock() - begun) / inner)
    return [statistics.median(t) for t in times]


def calls_for(work: float, per_second: float, sample_s: float = 0.05) -> int:
    """Calls of `work` (FLOPs or bytes) that take about `sample_s` at `per_second`: the same on every rank."""
    return max(1, int(sample_s * per_second / max(work, 1.0)))


def interleaved(samples: list, repeats: int, sync, barrier, clock) -> list[float]:
    """The median over `repeats` rounds of one call's seconds on `clock`, for each (fn, calls) of `samples`: every
    round times each in turn (`calls` calls after a `barrier`), so that a machine whose speed drifts over seconds
    (a shared host's) slows all of them alike, and the shapes a curve is fitted to are timed at one speed."""
    for fn, _ in samples:  # warm-up
        fn()
    sync()
    times = [[] for _ in samples]
    for _ in range(repeats):
        for (fn, calls), t in zip(samples, times):
            barrier()
            begun = clock()
            for _ in range(calls):
                fn()
            sync()
            t.append((clock() - begun) / calls)
    return [statistics.median(t) for t in times]
