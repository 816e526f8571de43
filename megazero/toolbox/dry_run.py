"""The dry run: one training step of a layout at its real size, in one CPU process, with no compute.

    python tools/dry_run.py configs/gpt3_175b.yaml --world-size 1024 [key=value ...]

`dry_run(config, overrides, world_size)` runs, for each simulated rank in turn, the trainer's own
code (`megazero.engine.initialize_from_config`: the process groups, the model built for the rank's
stage, the ZeRO optimizer, the engine; then one `train_batch`) with

- every tensor on the meta device: shapes, dtypes and the same operators, no data and no memory;
- torch's ``fake`` process group (`torch.testing._internal.distributed.fake_pg`): every collective
  and p2p returns at once, and every group's operations are posted, as the order check posts them,
  to a `Recorder` (kind, dtype, count, op, root or peer, tag, call site, and the tensors' device);
- a `LiveBytes` dispatch mode that counts the bytes of every storage alive (parameters, gradients,
  optimizer states, buffers, activations and temporaries) and keeps the peak through the step.
  Host reads of a tensor (``.item()``: the loss, the gradient norm, the overflow flag) get a stand-in
  (`STAND_IN`): 0 for integers and flags (finite, no overflow), 1.0 for floats.

Then it checks what NCCL would reject or hang on: every tensor that enters a collective is on the
compute device (here meta; a CPU tensor is reported with the rank, group and call site), the
members of every group that were simulated issue the same sequence, and every send between two
simulated ranks has its receive, in order, with the same shape and dtype.

Which ranks (`proof_ranks`). Ranks are symmetric along dp (they differ only in their data) and along
tp (they differ only in which shard they hold), and the middle pipeline stages run the same layers
as each other. So the dry run takes every pipeline stage at dp rank 0 and tp rank 0 (every boundary
has both its ends, every stage its own peak) and, at the first and the last stage (the embedding,
the head and their tied-weight group), dp rank dp-1 and tp rank tp-1 too: each dp and tp group
there has two simulated members to compare, and every cp rank (the ring of context parallelism). pp + 4
ranks (+ 2·(cp−1)); `every_stage=True` adds the two at every
stage (3 x pp), `ranks=` takes any set.

Stand-ins for what depends on the data: MoE routing (with ep > 1 the all-to-all's split sizes are
read on the host; the experts' padded fallback reads the busiest expert's count) cannot run on meta;
a Mixture-of-Experts config is refused by name.
"""
from __future__ import annotations

import dataclasses
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megazero.run.memory import LiveTensorBytes
from megazero.runtime.order_check import COMM_FILES, call_site

_COMM_FILES = COMM_FILES + ("toolbox/dry_run.py",)  # call sites are the first frame outside these
STAND_IN = {"int": 0, "bool": False, "float": 1.0}
"""What a host read (``.item()``, ``bool(t)``) of a meta tensor returns in the dry run, by dtype kind."""


class DryRunError(RuntimeError):
    """The dry run found what NCCL would hang on or reject."""


class LiveBytes(LiveTensorBytes):
    """`LiveTensorBytes` on the meta device: counts every storage an operator creates while active (the
    dry run builds the model under it, so parameters and optimizer states are among them) and answers host
    reads of meta tensors with `STAND_IN`."""

    def __init__(self):
        super().__init__(seed=False)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            t = args[0]
            if t.is_floating_point():
                return STAND_IN["float"]
            return STAND_IN["bool"] if t.dtype == torch.bool else STAND_IN["int"]
        return super().__torch_dispatch__(func, types, args, kwargs)


class FusedAttention(TorchFunctionMode):
    """On meta, `F.scaled_dot_product_attention` would take the math path (it keeps the (s, s) attention
    probabilities for backward); a GPU takes the flash kernel, which keeps the output and one log-sum-exp
    per row. This mode sends causal, unmasked attention on meta to the flash operator (its meta kernel),
    so activations are counted as a GPU holds them. Masked attention (ALiBi) stays math, as on a GPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = args[:3]
            if q.device.type == "meta" and kwargs.get("attn_mask") is None and len(args) == 3:
                if kwargs.get("enable_gqa") and k.shape[1] != q.shape[1]:  # (b, h_kv, s, d) -> (b, h, s, d)
                    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
                    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
                out = torch.ops.aten._scaled_dot_product_flash_attention(
                    q, k, v, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False), False,
                    scale=kwargs.get("scale"))
                return out[0]
        return func(*args, **kwargs)


@dataclasses.dataclass
class Recorder:
    """One simulated rank's operations, posted by `megazero.runtime.comm` as to the order check:
    collectives per communicator (its member ranks; the background group apart), p2p per
    (source, destination), and every tensor found off the compute device."""

    rank: int
    device_type: str = "meta"
    collectives: dict = dataclasses.field(default_factory=lambda: defaultdict(list))
    p2p_ops: dict = dataclasses.field(default_factory=lambda: defaultdict(list))
    off_device: list = dataclasses.field(default_factory=list)

    def collective(self, group, kind: str, compared: str, tensors=()) -> None:
        site = call_site(_COMM_FILES)
        self._check_device(group, kind, tensors, site)
        key = ("background",) if group.axis == "background" else group.ranks
        self.collectives[key].append((kind, compared, f"on {group.axis} at {site}"))

    def p2p(self, group, kind: str, peer: int, compared: str, tensors=()) -> None:
        site = call_site(_COMM_FILES)
        self._check_device(group, kind, tensors, site)
        me, other = group.ranks[group.rank], group.ranks[peer]
        pair = (me, other) if kind == "send" else (other, me)
        self.p2p_ops[pair].append((kind, compared, f"on {group.axis} at {site}"))

    def plain(self) -> "Recorder":
        """This record with plain dicts (picklable: it travels back from a worker process)."""
        return Recorder(self.rank, self.device_type, dict(self.collectives), dict(self.p2p_ops), list(self.off_device))

    def _check_device(self, group, kind, tensors, site) -> None:
        for t in tensors:
            if t.device.type != self.device_type:
                self.off_device.append(f"rank {self.rank}: {kind} on group {group.axis} (ranks {list(group.ranks)}) "
                                       f"got a {t.device.type} tensor {t.dtype} {tuple(t.shape)} at {site}")


def proof_ranks(topology, every_stage: bool = False) -> list[int]:
    """The ranks the dry run simulates: every pipeline stage at dp rank 0 and tp rank 0 (each
    boundary's two ends, each stage's peak), and a second member of its dp group (dp rank dp-1) and
    of its tp group (tp rank tp-1) at the first and the last stage, where stages differ (the
    embedding, the head, the tied-weight group), with every member of its cp group there (context
    parallelism: ring attention passes blocks from each cp rank to the next, so the whole ring is needed to
    match every send); with `every_stage`, at every stage."""
    out = set()
    for pp in range(topology.pp):
        out.add(topology.rank(pp=pp))
        if every_stage or pp in (0, topology.pp - 1):
            out.add(topology.rank(pp=pp, dp=topology.dp - 1))
            out.add(topology.rank(pp=pp, tp=topology.tp - 1))
            out.update(topology.rank(pp=pp, cp=c) for c in range(topology.size("cp")))
    return sorted(out)


def simulate_rank(cfg, rank: int, world_size: int) -> tuple[Recorder, LiveBytes, dict]:
    """One rank's step on meta under a fake process group: its recorder, its memory mode, and the
    planner-comparable breakdown (`memory_report` of the optimizer)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megazero.engine import initialize_from_config
    from megazero.run.memory import SavedActivationMeter, memory_report

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    recorder = Recorder(rank)
    mode = LiveBytes()
    try:
        with FusedAttention(), mode:
            engine, optimizer, data, _ = initialize_from_config(cfg, device="meta", order=recorder)
            states = mode.current()
            checkpointer = engine.module.activation_checkpointer
            meter = SavedActivationMeter(engine.module, checkpointer=checkpointer)
            with meter.measure():
                engine.train_batch(data)
            report = memory_report(optimizer, meter, checkpointer)
        report["live_before_step"] = states
    finally:
        dist.destroy_process_group()
    return recorder, mode, report


def _simulate_job(job):
    cfg, rank, world = job
    t0 = time.monotonic()
    recorder, mode, report = simulate_rank(cfg, rank, world)
    return rank, recorder.plain(), mode.peak, report, time.monotonic() - t0


def dry_run(config, overrides=(), world_size: int | None = None, ranks=None, progress=None, workers: int = 1,
            every_stage: bool = False) -> dict:
    """Simulate `ranks` (default `proof_ranks`) of the layout; the report: per rank peak bytes, the
    planner's prediction per stage, and the problems found (`problems`: empty when none)."""
    from megazero.core.config import topology_of
    from megazero.engine import load_run_config

    cfg = load_run_config(config, list(overrides), world_size=world_size)
    if cfg.model.moe is not None and cfg.model.moe.num_experts:
        raise DryRunError("model.moe: Mixture-of-Experts routing depends on the data and cannot run on the meta "
                          "device yet; dry-run the dense layout, or plan the MoE one with tools/plan.py")
    topology = topology_of(cfg)
    world = topology.world_size
    ranks = sorted(ranks) if ranks is not None else proof_ranks(topology, every_stage)
    recorders, per_rank = {}, {}
    start = time.monotonic()
    jobs = [(cfg, r, world) for r in ranks]
    if workers > 1 and len(ranks) > 1:  # one process per core: each simulates whole ranks (fork: nothing re-imported)
        import multiprocessing as mp

        pool = mp.get_context("fork").Pool(min(workers, len(ranks)))
        results = pool.imap(_simulate_job, jobs)
    else:
        pool, results = None, map(_simulate_job, jobs)
    try:
        for i, (r, recorder, peak, report, seconds) in enumerate(results):
            recorders[r] = recorder
            c = topology.coords(r)
            held = sum(v for k, v in report.items() if k != "live_before_step")
            per_rank[r] = {"pp": c.pp, "dp": c.dp, "tp": c.tp, "peak_bytes": held, "peak_live_bytes": peak,
                           "report": report, "seconds": seconds}
            if progress is not None:
                progress(f"rank {r} (pp={c.pp}, dp={c.dp}, tp={c.tp}): {_size(held)} model states and activations, "
                         f"{_size(peak)} peak of all live tensors [{i + 1}/{len(ranks)}, {seconds:.1f}s]")
    finally:
        if pool is not None:
            pool.terminate()
    problems = [line for rec in recorders.values() for line in rec.off_device]
    problems += compare_collectives(recorders) + compare_p2p(recorders)
    return {"world_size": world, "ranks": ranks, "per_rank": per_rank, "problems": problems,
            "seconds": time.monotonic() - start, "predicted": _predicted(cfg),
            "checked": _checked(recorders)}


def compare_collectives(recorders: dict) -> list[str]:
    """Every communicator's simulated members must have issued the same sequence."""
    problems = []
    groups = defaultdict(dict)
    for r, rec in recorders.items():
        for key, seq in rec.collectives.items():
            groups[key][r] = seq
    for key, members in groups.items():
        first, *others = sorted(members)
        for other in others:
            a, b = members[first], members[other]
            for pos in range(max(len(a), len(b))):
                x = a[pos] if pos < len(a) else None
                y = b[pos] if pos < len(b) else None
                if x is None or y is None or x[:2] != y[:2]:
                    problems.append(f"group {list(key)} diverges at operation #{pos}:\n  rank {first}: "
                                    f"{' '.join(x) if x else 'nothing'}\n  rank {other}: {' '.join(y) if y else 'nothing'}")
                    break
    return problems


def compare_p2p(recorders: dict) -> list[str]:
    """Every send between two simulated ranks has its receive, in order, same shape and dtype."""
    problems = []
    for src, rec in recorders.items():
        for (s, d), seq in rec.p2p_ops.items():
            if s != src or d not in recorders:
                continue
            recvs = recorders[d].p2p_ops.get((s, d), [])
            for pos in range(max(len(seq), len(recvs))):
                x = seq[pos] if pos < len(seq) else None
                y = recvs[pos] if pos < len(recvs) else None
                if x is None or y is None or x[1] != y[1]:
                    problems.append(f"p2p {s} -> {d} diverges at operation #{pos}:\n  rank {s}: "
                                    f"{' '.join(x) if x else 'no send'}\n  rank {d}: {' '.join(y) if y else 'no receive'}")
                    break
    return problems


def _checked(recorders: dict) -> dict:
    """What was compared: groups with two or more simulated members, p2p pairs with both ends."""
    groups = defaultdict(set)
    for r, rec in recorders.items():
        for key in rec.collectives:
            groups[key].add(r)
    pairs = {pair for rec in recorders.values() for pair in rec.p2p_ops if pair[0] in recorders and pair[1] in recorders}
    ops = sum(len(seq) for rec in recorders.values() for seq in rec.collectives.values())
    p2p = sum(len(seq) for rec in recorders.values() for seq in rec.p2p_ops.values())
    return {"groups_compared": sum(1 for m in groups.values() if len(m) > 1), "groups_seen": len(groups),
            "p2p_pairs_matched": len(pairs), "collectives": ops, "p2p": p2p}


def _predicted(cfg) -> dict | None:
    """The planner's memory plan per pipeline stage (bytes), or None when it cannot plan this run."""
    try:
        from megazero.planner.from_config import predicted_memory

        plan, _ = predicted_memory(cfg, device="cuda")
    except Exception:  # the planner's refusals are reported by tools/plan.py; the dry run goes on
        return None
    return plan


def format_report(out: dict) -> str:
    """The dry run's report as text: ranks, time, per-stage memory (with the planner's total when it can
    plan the layout), the problems."""
    lines = [f"dry run: {len(out['ranks'])} of {out['world_size']} ranks simulated in {out['seconds']:.0f} s: "
             f"{out['ranks'] if len(out['ranks']) <= 24 else str(out['ranks'][:24])[:-1] + ', ...]'}"]
    c = out["checked"]
    lines.append(f"  {c['collectives']} collectives on {c['groups_seen']} groups ({c['groups_compared']} compared "
                 f"between two or more members), {c['p2p']} p2p ops ({c['p2p_pairs_matched']} pairs matched)")
    held, live = defaultdict(int), defaultdict(int)  # per stage, the most of its simulated ranks
    for info in out["per_rank"].values():
        held[info["pp"]] = max(held[info["pp"]], info["peak_bytes"])
        live[info["pp"]] = max(live[info["pp"]], info["peak_live_bytes"])
    plan = {st.stage: st.total for st in out["predicted"].stages} if out["predicted"] is not None else None
    lines.append("  per rank: model states + activations kept for backward at their peak (as memory_report counts) / "
                 "peak of every live tensor (with temporaries)"
                 + (" / the planner's device total (with transients and fragmentation)" if plan else ""))
    for stage in sorted(held):
        lines.append(f"  stage {stage:>2}: {_size(held[stage]):>10} / {_size(live[stage]):>10}"
                     + (f" / {_size(plan[stage]):>10}" if plan else ""))
    if plan is None:
        lines.append("  (the planner cannot plan this layout: tools/plan.py says why)")
    if out["problems"]:
        lines.append(f"{len(out['problems'])} problem(s):")
        lines += ["  " + p.replace("\n", "\n  ") for p in out["problems"]]
    else:
        lines.append("no problem found: every collective agreed, every send has its receive, every tensor on the device")
    return "\n".join(lines)


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def main(argv=None) -> int:
    """tools/dry_run.py: exit 0 when nothing was found, 1 when problems were, 2 on a bad config."""
    import argparse
    import json
    import os

    from megazero.core.config import ConfigError

    ap = argparse.ArgumentParser(prog="tools/dry_run.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="a config file (YAML or DeepSpeed JSON)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, as the trainer takes them")
    ap.add_argument("--world-size", type=int, required=True, help="the number of ranks to dry-run")
    ap.add_argument("--ranks", default=None,
                    help="comma-separated ranks to simulate (default: every stage, plus a second dp and tp member "
                         "at the first and last stage)")
    ap.add_argument("--every-stage", action="store_true", help="a second dp and tp member at every stage")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="processes (default: 2)")
    ap.add_argument("--json", default=None, help="also write the report (peaks, problems, time) here")
    args = ap.parse_intermixed_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
    try:
        out = dry_run(args.config, args.overrides, args.world_size, ranks=ranks, workers=args.workers,
                      every_stage=args.every_stage, progress=lambda line: print(line, flush=True))
    except (ConfigError, DryRunError) as err:
        print(f"dry_run: {err}", flush=True)
        return 2
    print(format_report(out), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in out.items() if k != "predicted"}, f, indent=1, default=str)
    return 1 if out["problems"] else 0
