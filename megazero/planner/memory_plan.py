"""Memory per GPU and pipeline stage of a layout, before launch (pure: no torch, no processes).

`predict_memory(spec, layout, facts)` gives, for every pipeline stage (its TP and DP ranks hold the
same), the bytes megazero holds by the categories `megazero.run.memory.memory_report` measures:

* ``params, grads, master, optimizer_states, comm_buffers``: the ZeRO optimizer's flat groups between
  steps (`megazero.zero.flat_group.FlatGroup.memory`). The groups are rebuilt here exactly as
  `megazero.zero.grouping.make_groups` builds them, from the per-parameter shapes of megazero's layers
  (`layer_params`; checked against the meta-device counts in `facts`), and laid out by the same
  `megazero.core.flat_buffer.build_layout`. A Mixture-of-Experts model's routed experts (E / ep per
  layer on a rank, moe_plan.py) are a group of their own over the (dp / ep) x cp ranks holding the same
  experts (stages 0-2 at min(stage, 2); stage 3 sharded per unit); router and shared experts go with
  the dense parameters. Per group of padded size P elements over its n ranks (dp x cp: with context
  parallelism every cp rank holds the same parameters and `grouping.make_groups` shards over
  ``dp_cp_group``; (dp / ep) x cp for the experts), owned slice S = P (stage 0) or P / n (stages 1-3),
  working dtype of w bytes:
  params P·w (stage-3 sharded groups: S·w, the gathered buckets are empty between steps); grads fp32 as
  megazero accumulates them: P·4 at stages 0-1, S·4 at 2-3; master S·4 when the working dtype is not
  fp32 or the group is offloaded (otherwise the master is a view of the params); optimizer_states
  2·S·4 (two fp32 moment buffers, also for SGD); comm_buffers between steps: only the pinned host
  staging of offloaded gradients on an accelerator, S·4.
* ``activations``: the peak of device bytes autograd keeps for backward plus the recompute working set
  over one step (what `SavedActivationMeter` reports as ``device_total``), from `activation_chunks`
  (every tensor megazero's layers save, derived in activation_ledger.py) walked through the stage's
  pipeline program (`megazero.core.schedules.get_schedule`): a Forward adds its chunk's bytes, a
  Backward (or zero-bubble B) releases them in reverse order, rebuilding each recompute region first.
* ``activations_host``: the peak of checkpoints kept in host memory (``cpu_checkpointing``);
  ``checkpoint_buffer``: the stage's contiguous checkpoint buffer (``contiguous_memory_optimization``),
  which the meter also counts inside ``activations`` (or ``activations_host``), as the total counts it once.

* ``grad_buckets``: stages 2-3's gradient bucket slots, made in the first micro-batch and kept for the run
  (`flat_group.SlotPool`): one per bucket size (`bucket_pool`; the runtime can keep one more or one fewer,
  `largest_slot`), and MAX_INFLIGHT more of the largest on an accelerator with overlap_comm.

Beyond what memory_report can see, `transient` names what adds to the stage's peak during a step, each at the
moment it is alive in the walked program (`program_peaks.walk_program`): ``logits`` (the head's logits
and their fp32 shifted copy while the loss runs), ``backward_working`` (at a chunk's last block's first GEMM in
backward: the incoming gradient, its SP all-gather or the hidden dropout's gradient, the MLP output
projection's input and weight gradients,
`activation_ledger.backward_working`; with context parallelism the attention core's backward working set when
higher, `cp_ledger.core_working`: on a GPU the ring's fp32 scores of one chunk pair), ``wgrad_pending`` (zero
bubble: the inputs and output
gradients kept between B and W, and the small weight gradients B computed and holds) and ``zero_buffers``
(ZeRO's gradient reduce-scatter outputs after each backward, MAX_INFLIGHT of them with overlap_comm, on a
CPU with gloo's copy of each reduce-scatter's input, and ZeRO-3's gathered last unit and the units its
backward prefetches when a backward starts, `gathered_edge`, and the head's again while the loss's logits
are alive, `gathered_head`): each is the rise of the walked peak it causes. The
stage's peak of live bytes (the breakdown plus the transients, host and device alike on a CPU) is measured
against `megazero.run.memory.LiveTensorBytes` on generated CPU layouts (benchmarks/planner_cpu.py). The
communication options add 1-bit Adam's error buffers to ``optimizer_states`` and the transients
``hpz_secondary`` and ``zeropp_int8`` (comm_memory.py), counted whole on top.

The device total of a stage is what is not in host memory (offloaded master, moments and staging) plus
the transients, times (1 + `fragmentation`): a stated allowance for the caching allocator's rounding
and fragmentation (default `FRAGMENTATION`, a planning margin, not a measurement; measured CPU
breakdowns are exact byte counts and compare without it). The plan names the tightest stage and,
given a `Hardware`, every stage that would not fit and by how many GB.
"""
from __future__ import annotations

from dataclasses import dataclass

from megazero.core.flat_buffer import FlatLayout, build_layout
from megazero.planner.programs import schedule_programs
from megazero.core.simulate import peaks as in_flight_peaks
from megazero.planner.activation_ledger import activation_chunks, checkpoint_pool
from megazero.planner.program_peaks import walk_program
from megazero.planner.comm_memory import option_memory
from megazero.planner.layout import PlanError
from megazero.planner.layer_params import layer_params
from megazero.planner.stages import pipeline_layers

FRAGMENTATION = 0.10
"""Allowance for allocator fragmentation, as a fraction of a stage's device bytes: PyTorch's caching
allocator rounds every block up (512 B small, 2 MiB large blocks cut from 20 MiB segments) and keeps
freed blocks cached, so the reserved memory of a training step runs above the live bytes. A stated
margin for planning (``expandable_segments:True`` lowers it), never used against measurements."""

MAX_INFLIGHT = 2
"""`megazero.zero.flat_group.FlatGroup.MAX_INFLIGHT`: asynchronous gradient reductions alive at once."""

CATEGORIES = ("params", "grads", "master", "optimizer_states", "comm_buffers", "grad_buckets", "activations",
              "activations_host", "checkpoint_buffer")
GB = 1e9


@dataclass(frozen=True)
class _Group:
    name: str
    layout: FlatLayout
    stage: int  # the ZeRO stage the group runs at (stage 3's persistent group: 2)
    shard_params: bool
    offload: bool
    shared_bucket: int | None = None  # stage 3, pp = 1: the bucket of the tied embedding, used by two units
    bucket_units: tuple[int, ...] = ()  # stage 3's sharded groups: the unit (layer) of each bucket


def flat_groups(spec, layout, chunks, persistence_threshold: int) -> list[_Group]:
    """This stage's flat groups, as `megazero.zero.grouping.make_groups` makes them from the parameter
    order of `megazero.engine.factories.param_groups` (Megatron's split: matrices, then vectors, each in
    model order; pp=1 shares the tied weight, counted once): the routed experts first, then the rest,
    each laid out in the order backward completes it (`megazero.zero.grouping._backward_order`)."""
    params = []  # (Param, unit)
    for chunk in chunks:
        for kind, unit in chunk:
            params += [(p, unit) for p in layer_params(spec, kind, layout.tp, layout)]
    if layout.pp == 1 and spec.tie_embeddings:
        tied_seen = False
        kept = []
        for p, u in params:
            if p.tied and tied_seen:
                continue  # the head's weight is the embedding's parameter (build_pipeline_model)
            tied_seen = tied_seen or p.tied
            kept.append((p, u))
        params = kept
    seen_in_unit: dict[int, int] = {}
    backward_key = {}  # id of a (Param, unit) pair -> its place in backward order (grouping._backward_order)
    for x in params:
        j = seen_in_unit[x[1]] = seen_in_unit.get(x[1], -1) + 1
        backward_key[id(x)] = (-x[1], -j)  # the last unit first; inside a unit, reverse registration order

    def backward_order(xs):
        return sorted(xs, key=lambda x: backward_key[id(x)])

    ordered = [x for x in params if x[0].matrix] + [x for x in params if not x[0].matrix]
    experts = [x for x in ordered if x[0].expert]
    ordered = [x for x in ordered if not x[0].expert]
    tied = [x for x in ordered if layout.pp > 1 and x[0].tied]
    rest = [x for x in ordered if not (layout.pp > 1 and x[0].tied)]
    dp, bucket, opt = layout.dp_cp, layout.reduce_bucket_size, layout.offload_optimizer  # dp x cp replicas
    groups = []
    if experts and layout.zero == 3:
        experts, cuts = _by_unit(experts)
        lay = build_layout([x[0].numel for x in experts], layout.edp_cp, bucket, cuts)
        groups.append(_Group("experts", lay, 3, True, layout.offload_param or opt, None, _units(experts, lay)))
    elif experts:
        groups.append(_Group("experts", build_layout([x[0].numel for x in backward_order(experts)], layout.edp_cp,
                                                     bucket), min(layout.zero, 2), False, opt))
    if layout.zero == 3:
        sharded, cuts = _by_unit([x for x in rest if x[0].numel >= persistence_threshold])
        persistent = [x for x in rest if x[0].numel < persistence_threshold]
        if sharded:
            lay = build_layout([x[0].numel for x in sharded], dp, bucket, cuts)
            shared = next((lay.bucket_of(i) for i, x in enumerate(sharded) if x[0].tied), None)
            groups.append(_Group("sharded", lay, 3, True, layout.offload_param or opt, shared, _units(sharded, lay)))
        if persistent:
            groups.append(_Group("persistent", build_layout([x[0].numel for x in backward_order(persistent)], dp,
                                                            bucket), 2, False, opt))
    elif rest:
        groups.append(_Group("main", build_layout([x[0].numel for x in backward_order(rest)], dp, bucket),
                             layout.zero, False, opt))
    if tied:
        shard = layout.zero == 3
        lay = build_layout([x[0].numel for x in tied], dp, bucket)
        groups.append(_Group("tied", lay, layout.zero, shard, opt or (shard and layout.offload_param), None,
                             _units(tied, lay)))
    return groups


def _units(pairs: list, lay: FlatLayout) -> tuple[int, ...]:
    """The unit of each bucket of `lay`, laid out from the (Param, unit) `pairs` (a bucket holds one unit's)."""
    return tuple(pairs[bk.params[0]][1] for bk in lay.buckets)


def _by_unit(params: list) -> tuple[list, list[int]]:
    """(Param, unit) pairs in reverse unit order and the indices where a unit starts (grouping._by_unit)."""
    ordered = sorted(params, key=lambda x: -x[1])
    return ordered, [i for i in range(1, len(ordered)) if ordered[i][1] != ordered[i - 1][1]]


def group_memory(g: _Group, w: int, accelerator: bool) -> tuple[dict[str, int], dict[str, int]]:
    """(bytes by category, of which in host memory) of one flat group between steps (FlatGroup.memory)."""
    padded = g.layout.total
    owned = padded if g.stage == 0 else g.layout.shard_numel
    separate_master = w != 4 or g.offload
    mem = {"params": (g.layout.shard_numel if g.shard_params else padded) * w,
           "grads": (padded if g.stage <= 1 else g.layout.shard_numel) * 4,
           "master": owned * 4 if separate_master else 0,
           "optimizer_states": 2 * owned * 4,
           "comm_buffers": owned * 4 if g.offload and accelerator else 0}  # FlatGroup._host_grad
    host = {}
    if g.offload:
        host = {k: mem[k] for k in ("master", "optimizer_states", "comm_buffers")}
        if g.shard_params:
            host["params"] = mem["params"]  # the shard lives on the host with the optimizer
    return mem, host


def bucket_pool(g: _Group, overlap: bool, accelerator: bool) -> int:
    """Bytes of a group's gradient bucket slots (stages 2-3, `flat_group.SlotPool`: made in the first
    micro-batch, kept for the run; memory_report's ``grad_buckets``): a slot is taken by a bucket's first
    gradient and given back at its reduction's launch on a CPU (gloo copies its input) or, on an
    accelerator, at its end, so overlap_comm keeps MAX_INFLIGHT more of the largest; a free slot serves
    only a bucket of its own size: one slot per bucket size."""
    if g.stage <= 1:
        return 0
    sizes = {b.numel for b in g.layout.buckets}
    extra = MAX_INFLIGHT * max(sizes, default=0) if overlap and accelerator else 0
    return (sum(sizes) + extra) * 4


def largest_slot(spec, layout, stage: int, persistence_threshold: int = 100_000) -> int:
    """fp32 bytes of the largest gradient bucket of pipeline stage `stage`: what ``grad_buckets`` can be off
    by (`bucket_pool` predicts one slot per bucket size; the runtime keeps a slot more where zero bubble's
    deferred W holds two micro-batches' buckets open, or fewer where a bucket size never opens alone)."""
    chunks = pipeline_layers(spec, layout)[stage]
    return 4 * max((b.numel for g in flat_groups(spec, layout, chunks, persistence_threshold)
                    for b in g.layout.buckets), default=0)


def reduce_outputs(g: _Group, overlap: bool, accelerator: bool) -> int:
    """Bytes a group's gradient reduction allocates while it runs (on top of the bucket slots): stages
    1-3 reduce-scatter each fp32 bucket into a temporary shard of 1/dp of it (MAX_INFLIGHT of them in
    flight with overlap_comm), and on a CPU gloo's reduce-scatter first copies its whole input (measured:
    a 4 MiB input, 4 MiB more while it runs); stage 0 all-reduces in place (gloo too)."""
    if g.stage == 0:
        return 0
    big = max((b.numel for b in g.layout.buckets), default=0)
    copied = not accelerator and g.layout.dp_size > 1  # (one rank: the shard is copied out, nothing reduced)
    each = big // g.layout.dp_size * 4 + (big * 4 if copied else 0)
    return each * (min(MAX_INFLIGHT, len(g.layout.buckets)) if overlap else 1)


def _last_unit(g: _Group) -> list:
    """The buckets of the group's last unit (backward order puts them first); a group that records no units
    (`_Group.bucket_units`) as one bucket per unit."""
    units = g.bucket_units or tuple(range(len(g.layout.buckets)))
    return [b for b in g.layout.buckets if units[b.index] == units[0]]


def gathered_edge(g: _Group, w: int, prefetch: int) -> int:
    """ZeRO-3: bytes gathered when a chunk's backward starts, its activations all alive
    (`megazero.zero.stage3`): the last unit's buckets and the previous units' ones its backward pre-hook
    prefetches, in backward order while they fit in `prefetch` elements (``zero.prefetch_bucket_size``; it
    stops at the first that does not)."""
    last = _last_unit(g)
    gathered = sum(b.numel for b in last)
    for b in g.layout.buckets[len(last):]:
        if prefetch < b.numel:
            break
        prefetch -= b.numel
        gathered += b.numel
    return gathered * w


def gathered_head(g: _Group, w: int, head_unit: int | None) -> int:
    """ZeRO-3: bytes of the head's buckets (unit `head_unit`, None on a stage without the head), gathered again
    as the loss's gradient reaches the head, its logits still alive."""
    if head_unit is None:
        return 0
    return sum(b.numel for b, u in zip(g.layout.buckets, g.bucket_units) if u == head_unit) * w


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage (each of its TP x DP ranks): `breakdown` by the measured categories, `host`
    (of those, bytes in host memory), `transient` (peaks inside a step, see the module docstring),
    `fragmentation` (the allowance, bytes) and `total`: device bytes including all of them."""

    stage: int
    breakdown: dict[str, int]
    host: dict[str, int]
    transient: dict[str, int]
    fragmentation: int
    counted_twice: int = 0  # device bytes in two categories (a contiguous checkpoint buffer: activations too)

    @property
    def device_bytes(self) -> int:
        """Device bytes before the fragmentation allowance."""
        return (sum(v - self.host.get(k, 0) for k, v in self.breakdown.items()) + sum(self.transient.values())
                - self.counted_twice)

    @property
    def total(self) -> int:
        return self.device_bytes + self.fragmentation


@dataclass(frozen=True)
class MemoryPlan:
    """Per-stage memory of one layout; `tightest` is the stage with the largest total; `over` lists
    (stage, GB above the device) for each stage that would not fit `hbm_bytes` (when known)."""

    layout: object
    stages: tuple[StageMemory, ...]
    hbm_bytes: float | None = None
    fragmentation: float = FRAGMENTATION

    @property
    def tightest(self) -> StageMemory:
        return max(self.stages, key=lambda st: st.total)

    @property
    def over(self) -> list[tuple[int, float]]:
        if self.hbm_bytes is None:
            return []
        return [(st.stage, (st.total - self.hbm_bytes) / GB) for st in self.stages if st.total > self.hbm_bytes]

    @property
    def fits(self) -> bool:
        return not self.over

    def table(self) -> str:
        """One line per stage: every non-zero category, transient and the total in GB, the tightest
        stage marked with *; then whether it fits the device."""
        cols = [c for c in CATEGORIES if any(st.breakdown[c] for st in self.stages)]
        trans = sorted({k for st in self.stages for k, v in st.transient.items() if v})
        head = ["stage"] + cols + trans + ["fragmentation", "total"]
        widths = [max(8, len(c)) for c in head]
        lines = ["  ".join(f"{c:>{n}}" for c, n in zip(head, widths))]
        tight = self.tightest.stage
        for st in self.stages:
            vals = ([st.breakdown[c] for c in cols] + [st.transient.get(k, 0) for k in trans]
                    + [st.fragmentation, st.total])
            cells = [("*" if st.stage == tight else " ") + f"{st.stage:>{widths[0] - 1}}"]
            cells += [f"{v / GB:>{n}.3f}" for v, n in zip(vals, widths[1:])]
            lines.append("  ".join(cells))
        if self.hbm_bytes is not None:
            lines.append("fits" if self.fits else "does not fit: " + ", ".join(
                f"stage {s} by {gb:.2f} GB" for s, gb in self.over))
        return "\n".join(lines)


def _check_facts(spec, layout, facts, stages) -> None:
    """The meta-device counts (`facts`) must be the parameters the planner laid out, stage by stage: the
    dense ones, and the routed experts as the meta build holds them (every expert, split over the
    facts' `expert_tp`)."""
    if facts is None:
        return
    if len(facts.stages) != layout.pp:
        raise PlanError(f"model facts have {len(facts.stages)} stages, the layout pp={layout.pp}")
    for s, (fs, chunks) in enumerate(zip(facts.stages, stages)):
        built = layout.replace(dp=1, cp=1, zero=1, ep=1, moe_imbalance=1.0,
                               expert_tp=getattr(fs, "expert_tp", 1) if spec.moe is not None else None)
        groups = flat_groups(spec, built, chunks, 0)
        experts = sum(sum(g.layout.numels) for g in groups if g.name == "experts")
        mine = sum(sum(g.layout.numels) for g in groups) - experts
        blocks = sum(1 for chunk in chunks for kind, _ in chunk if kind == "block")
        if (mine + experts, experts, blocks) != (fs.params, fs.expert_params, fs.layers):
            moe = experts or fs.expert_params
            raise PlanError(f"stage {s}: the model facts count {fs.params} parameters"
                            + (f" ({fs.expert_params} routed experts)" if moe else "") + f" in {fs.layers} blocks, "
                            f"the planner's layers {mine + experts}" + (f" ({experts})" if moe else "")
                            + f" in {blocks}; megazero/planner/memory_plan.py:layer_params is out of date with "
                            f"the model's layers")


def predict_memory(spec, layout, facts=None, hardware=None, *, device: str = "cuda",
                   param_persistence_threshold: int = 100_000, fragmentation: float = FRAGMENTATION,
                   schedule_cache: dict | None = None) -> MemoryPlan:
    """The `MemoryPlan` of running `spec` (a `megazero.core.spec.ModelSpec`) on `layout` (a `Layout`).

    `facts`: the `ModelFacts` of the model on this layout (checked against the planner's parameter
    list); `hardware`: a `Hardware` whose memory the plan is checked against. `device` "cuda" (fused norm
    and causal-softmax kernels, flash attention) or "cpu" (megazero's PyTorch reference kernels: what CPU
    runs measure). `param_persistence_threshold`: ``zero.param_persistence_threshold`` (ZeRO-3 keeps
    smaller parameters whole). `schedule_cache`: a dict kept across calls, for the pipeline programs
    (`planner.programs`)."""
    layout.check(spec)
    if device not in ("cuda", "cpu"):
        raise PlanError(f"device={device!r} must be 'cuda' or 'cpu'")
    w = {"bf16": 2, "fp16": 2, "fp32": 4}[layout.precision]
    accelerator = device != "cpu"
    stages = pipeline_layers(spec, layout)
    _check_facts(spec, layout, facts, stages)
    programs = schedule_programs(layout.schedule, layout.pp, layout.num_microbatches, layout.chunks, cache=schedule_cache)
    counts = {kind: (sum(p.numel for p in ps if not p.matrix or p.moe), sum(p.numel for p in ps))
              for kind in ("embedding", "block", "head") for ps in [layer_params(spec, kind, layout.tp, layout)]}
    out = []
    for s, chunks in enumerate(stages):
        groups = flat_groups(spec, layout, chunks, param_persistence_threshold)
        breakdown = dict.fromkeys(CATEGORIES, 0)
        host: dict[str, int] = {}
        transient = {}
        gathered = reduced = reduced_at_end = head = 0
        head_unit = next((unit for chunk in chunks for kind, unit in chunk if kind == "head"), None)
        for g in groups:
            mem, off = group_memory(g, w, accelerator)
            for k, v in mem.items():
                breakdown[k] += v
            for k, v in off.items():
                host[k] = host.get(k, 0) + v
            breakdown["grad_buckets"] += bucket_pool(g, layout.overlaps, accelerator)
            if g.stage >= 2:
                reduced += reduce_outputs(g, layout.overlaps, accelerator)
            else:
                reduced_at_end += reduce_outputs(g, layout.overlaps, accelerator)
            if g.shard_params:
                gathered += gathered_edge(g, w, layout.prefetch_bucket_size)
                head += gathered_head(g, w, head_unit)
        states, more = option_memory(groups, layout, w)  # 1-bit Adam, ZeRO++ (comm_memory.py)
        breakdown["optimizer_states"] += states
        transient.update(more)
        ledger = activation_chunks(spec, layout, chunks, device, counts)
        pool = checkpoint_pool(spec, layout, chunks, in_flight_peaks(programs[s])[0])
        peaks = walk_program(programs[s], ledger, pool, layout.cpu_checkpointing, gathered, reduced, reduced_at_end,
                             head)
        breakdown["activations"] = peaks.metered
        breakdown["activations_host"] = peaks.host
        breakdown["checkpoint_buffer"] = pool  # also inside activations (or activations_host), as measured
        if peaks.host:
            host["activations_host"] = peaks.host
        if pool and layout.cpu_checkpointing:
            host["checkpoint_buffer"] = pool
        transient["logits"] = peaks.with_logits - peaks.metered
        transient["backward_working"] = peaks.working - peaks.with_logits
        transient["wgrad_pending"] = peaks.real - peaks.working
        transient["zero_buffers"] = peaks.live - peaks.real  # gathered parameters, reduce-scatter outputs
        twice = 0 if layout.cpu_checkpointing else pool  # the device buffer is in two categories
        st = StageMemory(s, breakdown, host, transient, 0, twice)
        out.append(StageMemory(s, breakdown, host, transient, round(st.device_bytes * fragmentation), twice))
    return MemoryPlan(layout, tuple(out), hardware.hbm_bytes if hardware is not None else None, fragmentation)

