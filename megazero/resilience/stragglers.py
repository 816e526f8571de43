"""Stragglers: ranks whose own compute is consistently slower than that of the ranks doing the same work.

Every rank keeps, for each step, its compute seconds: the step's wall time on the host less the seconds it
spent blocked in synchronous communication (`CommStats.waits`, by axis: TP's all-reduces, the pipeline's
receives, the data-parallel reductions, ...), so that the ranks waiting for a slow peer do not look slow
themselves; and those waits. Every `interval` steps the window is gathered over the world group (one
`all_gather_object` of a few floats per step and rank) and `find_stragglers` compares each rank with the
other ranks of its pipeline stage (the same layers: TP shards and DP replicas do the same work): a rank
slower than `ratio` times their median in at least `share` of the window's steps is named, with its numbers.
On a GPU with NCCL a synchronous collective returns at its launch, so the host's view cannot tell a slow
device from the peers waiting for it; the measurement is the host's (docs/running-for-weeks.md).
"""
from __future__ import annotations

import statistics
import time

from megazero.resilience.link_probe import LinkProbe, describe_links, find_slow_links
from megazero.runtime import comm


def find_stragglers(compute: list[list[float]], stages: list[int], ratio: float = 1.5, share: float = 0.75,
                    min_excess_s: float = 0.005) -> list[dict]:
    """The ranks slow in at least `share` of the steps: `compute[r][s]` is rank r's compute seconds at step s of
    the window, `stages[r]` its pipeline stage. Slow at a step: above `ratio` times the median of the other
    ranks of its stage and by more than `min_excess_s`. A rank alone in its stage is never named. Each:
    {"rank", "stage", "compute_s" (its median), "peers_s" (the median of its peers' medians), "ratio",
    "slow_steps", "steps"}. Local: no communication."""
    found = []
    steps = len(compute[0]) if compute else 0
    for r, row in enumerate(compute):
        peers = [q for q in range(len(compute)) if q != r and stages[q] == stages[r]]
        if not peers or not steps:
            continue
        slow = 0
        for s in range(steps):
            typical = statistics.median(compute[q][s] for q in peers)
            slow += row[s] > ratio * typical and row[s] - typical > min_excess_s
        if slow >= share * steps:
            mine, theirs = statistics.median(row), statistics.median(statistics.median(compute[q]) for q in peers)
            found.append({"rank": r, "stage": stages[r], "compute_s": round(mine, 6), "peers_s": round(theirs, 6),
                          "ratio": round(mine / max(theirs, 1e-12), 3), "slow_steps": slow, "steps": steps})
    return found


def summary(rows: list[list[float]]) -> dict:
    """{"median", "max", "max_rank"} over every rank's median of `rows` (per rank, per step)."""
    medians = [statistics.median(r) for r in rows]
    top = max(range(len(medians)), key=medians.__getitem__)
    return {"median": round(statistics.median(medians), 6), "max": round(medians[top], 6), "max_rank": top}


class StragglerWatch:
    """One rank's side (see the module docstring): `begin()` before a step, `end()` after it; every `interval`
    steps `end` gathers the window over `world` (every rank calls it at the same steps) and returns
    {"stragglers": [...], "compute_s": summary, "wait_s": {axis: summary}} on every rank, else None.
    `stats`: this rank's CommStats (ParallelContext.stats); `stage`: its pipeline stage. With a `links` probe
    (`megazero.resilience.link_probe`), each window also times every link of the grid first (point to point inside
    the pp, dp and tp groups) and adds "links" (the median link time by axis) and "slow_links" (named)."""

    def __init__(self, stats: comm.CommStats, world: comm.GroupHandle, stage: int, interval: int,
                 ratio: float = 1.5, links: LinkProbe | None = None, clock=time.perf_counter):
        self.stats, self.world, self.stage = stats, world, stage
        self.interval, self.ratio, self.links, self.clock = interval, ratio, links, clock
        self._window: list[tuple[float, dict[str, float]]] = []  # (compute s, {axis: wait s}) per step
        self._start, self._waits = 0.0, {}

    def begin(self) -> None:
        self._start, self._waits = self.clock(), self.stats.wait_seconds()

    def end(self) -> dict | None:
        wall = self.clock() - self._start
        now = self.stats.wait_seconds()
        waits = {axis: now[axis] - self._waits.get(axis, 0.0) for axis in now}
        self._window.append((max(0.0, wall - sum(waits.values())), waits))
        if len(self._window) < self.interval:
            return None
        window, self._window = self._window, []
        measured = self.links.run() if self.links is not None else []  # p2p inside the pp, dp and tp groups
        gathered = comm.all_gather_object((self.stage, window, measured), self.world)  # a few floats per step
        stages = [stage for stage, _, _ in gathered]
        compute = [[c for c, _ in w] for _, w, _ in gathered]
        axes = sorted({axis for _, w, _ in gathered for _, waits in w for axis in waits if not axis.endswith(".probe")})
        found = {"stragglers": find_stragglers(compute, stages, self.ratio),
                 "compute_s": summary(compute),
                 "wait_s": {axis: summary([[waits.get(axis, 0.0) for _, waits in w] for _, w, _ in gathered])
                            for axis in axes}}
        if self.links is not None:
            links = [link for _, _, mine in gathered for link in mine]
            found["slow_links"] = find_slow_links(links, self.ratio)
            found["links"] = {axis: {"median_s": statistics.median(t for x in links if x["axis"] == axis
                                                                   for t in x["seconds"]),
                                     "count": sum(x["axis"] == axis for x in links)}
                              for axis in sorted({x["axis"] for x in links})}
        return found


def describe(found: dict, first_step: int, last_step: int) -> list[str]:
    """The log lines of one gathered window (`StragglerWatch.end`)."""
    lines = [f"straggler: rank {s['rank']} (pipeline stage {s['stage']}): compute {s['compute_s'] * 1e3:.1f} ms per "
             f"step against {s['peers_s'] * 1e3:.1f} ms for the other ranks of its stage ({s['ratio']:.2f}x), slow in "
             f"{s['slow_steps']} of {s['steps']} steps ({first_step}-{last_step})" for s in found["stragglers"]]
    lines = lines or [f"stragglers: none in steps {first_step}-{last_step} (compute per step: median "
                      f"{found['compute_s']['median'] * 1e3:.1f} ms, slowest rank {found['compute_s']['max_rank']} "
                      f"{found['compute_s']['max'] * 1e3:.1f} ms)"]
    if "links" not in found:
        return lines
    return lines + (describe_links(found["slow_links"]) or [
        "slow links: none (one-way time, median by axis: " + ", ".join(
            f"{axis} {v['median_s'] * 1e3:.2f} ms over {v['count']} links" for axis, v in found["links"].items()) + ")"])
