"""Slow links: the pairs of ranks whose transfers are consistently slower than the job's other links of the same kind.

A step's waits cannot tell a slow link from a slow sender (a pipeline receive waits for both), so links are
measured on their own: every `StragglerWatch` window, `LinkProbe.run` times a ping-pong of `nbytes` over each
link of the grid's groups (the ring neighbours i, i+1 of every pp, dp and tp group: the rings their all-reduces
and the pipeline's sends use). The links of one axis are probed together, in at most three phases (a ring's
edges coloured so that each rank is in at most one exchange per phase), so the probe's length does not grow
with the job. Per link, the first side times `reps` round trips after a one-element handshake (both sides
ready) and keeps the best; the whole probe runs `rounds` times.

`find_slow_links` then compares, round by round, each link with the median of the other links of its axis (TP
inside a node, DP or PP across nodes: different fabrics): slower than `ratio` times it and by more than
`min_excess_s` in every round (`share` 1.0), it is named. An axis with a single link has nothing to compare
with and never names it. Measured with 8 ranks on 2 shared cores, where links probed together slow each other
unevenly: one probe of 3 round trips named a healthy link in 13 of 20 windows; 4 rounds of 2, with a link
named when slow in 3 of them, in 1 of 60 windows (2.4x, 2.6 ms over its peers' median); in all 4 rounds, in
none of 100. A link throttled to 200 MB/s is 5-8x its peers' in every round.

The probe's bytes are counted on the axes ``<axis>.probe`` of the groups' `CommStats`; the trainer leaves them out
of the steps' per-step volumes.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from megazero.runtime import comm


def ring_phases(n: int) -> list[list[tuple[int, int]]]:
    """The edges (i, i+1 mod n) of a ring of `n` group ranks in phases where no rank appears twice: even i,
    odd i, and for an odd ring the closing edge (n-1, 0) alone. A ring of 2 has the one edge (0, 1); of 1, none."""
    if n < 2:
        return []
    if n == 2:
        return [[(0, 1)]]
    edges = [(i, (i + 1) % n) for i in range(n)]
    phases = [[e for e in edges[:n - n % 2] if e[0] % 2 == p] for p in (0, 1)]
    if n % 2:
        phases.append([edges[-1]])
    return phases


class LinkProbe:
    """Times the links of `groups` (GroupHandles: the pp, dp, tp groups of this rank; every rank passes its
    own groups of the same axes in the same order) with `nbytes` buffers on `device`. `run()` communicates only
    point to point inside each group; every rank of the job must call it at the same step."""

    def __init__(self, groups: list[comm.GroupHandle], nbytes: int, device: torch.device | str = "cpu",
                 rounds: int = 4, reps: int = 2, clock=time.perf_counter):
        self.groups = [dataclasses.replace(g, axis=f"{g.axis}.probe") for g in groups if g.size > 1]
        self.rounds, self.reps, self.clock = rounds, reps, clock
        self.buffer = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        self.ping = torch.zeros(1, dtype=torch.float32, device=device)

    def _sync(self) -> None:
        if self.buffer.is_cuda:  # NCCL returns at the launch: the transfer is over when the stream is
            torch.cuda.synchronize(self.buffer.device)

    def _exchange(self, group: comm.GroupHandle, peer: int, first: bool, t: torch.Tensor) -> None:
        """One round trip with group rank `peer`: `first` sends then receives, the other side the reverse."""
        if first:
            comm.send(t, peer, group)
            comm.recv(t, peer, group)
        else:
            comm.recv(t, peer, group)
            comm.send(t, peer, group)

    def run(self) -> list[dict]:
        """Probe every link `rounds` times; returns the links this rank measured (it is their first side):
        {"axis", "ranks" [global, global], "bytes", "seconds" [one way, best of `reps`, per round]}."""
        found: dict[tuple, dict] = {}
        for _ in range(self.rounds):
            for link in self._round():
                found.setdefault((link["axis"], *link["ranks"]), {**link, "seconds": []})["seconds"].append(
                    link["seconds"])
        return list(found.values())

    def _round(self) -> list[dict]:
        found = []
        for group in self.groups:
            for phase in ring_phases(group.size):
                edge = next((e for e in phase if group.rank in e), None)
                if edge is None:
                    continue
                first = group.rank == edge[0]
                peer = edge[1] if first else edge[0]
                self._exchange(group, peer, first, self.ping)  # both sides are here (and NCCL's pair is connected)
                best = float("inf")
                for _ in range(self.reps):
                    start = self.clock()
                    self._exchange(group, peer, first, self.buffer)
                    self._sync()
                    best = min(best, self.clock() - start)
                if first:
                    found.append({"axis": group.axis.removesuffix(".probe"),
                                  "ranks": [group.global_rank(edge[0]), group.global_rank(edge[1])],
                                  "bytes": self.buffer.numel() * 4, "seconds": round(best / 2, 7)})
        return found


def find_slow_links(links: list[dict], ratio: float = 1.5, share: float = 1.0,
                    min_excess_s: float = 0.002) -> list[dict]:
    """The links slow in at least `share` of the rounds (`links`: `LinkProbe.run`'s records from every rank):
    slow in a round, above `ratio` times the median of the other links of its axis in that round and by more
    than `min_excess_s`. Each: {"axis", "ranks", "bytes", "seconds" (its median over the rounds), "peers_s"
    (the median of the other links' medians), "ratio", "gbps" (its bandwidth, GB/s), "slow_rounds", "rounds"}.
    Local: no communication."""
    slow = []
    for i, link in enumerate(links):
        peers = [other["seconds"] for j, other in enumerate(links) if j != i and other["axis"] == link["axis"]]
        rounds = len(link["seconds"])
        if not peers or not rounds:
            continue
        count = 0
        for k, mine in enumerate(link["seconds"]):
            typical = statistics.median(p[k] for p in peers)
            count += mine > ratio * typical and mine - typical > min_excess_s
        if count >= share * rounds:
            mine, theirs = statistics.median(link["seconds"]), statistics.median(statistics.median(p) for p in peers)
            slow.append({"axis": link["axis"], "ranks": link["ranks"], "bytes": link["bytes"], "seconds": mine,
                         "peers_s": theirs, "ratio": round(mine / max(theirs, 1e-12), 3),
                         "gbps": round(link["bytes"] / mine / 1e9, 3), "slow_rounds": count, "rounds": rounds})
    return slow


def describe_links(slow: list[dict]) -> list[str]:
    """The log lines naming each slow link."""
    return [f"slow link: {s['axis']} ranks {s['ranks'][0]}<->{s['ranks'][1]}: {s['bytes'] / 2**20:.1f} MiB in "
            f"{s['seconds'] * 1e3:.2f} ms ({s['gbps']:.2f} GB/s) against {s['peers_s'] * 1e3:.2f} ms for the other "
            f"{s['axis']} links ({s['ratio']:.2f}x), slow in {s['slow_rounds']} of {s['rounds']} rounds" for s in slow]
