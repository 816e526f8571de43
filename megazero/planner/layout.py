"""`Layout`: one way to run a model on a cluster, and its checks against the model and the batch.

Pure data; `check(spec)` raises `PlanError` with one clear line per problem (a layout that does not
divide the model or the batch, or that the runtime refuses), before anything is built.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

from megazero.core.instructions import ScheduleError
from megazero.core.checkpoint_rules import checkpointing_problems
from megazero.core.schedules import check_sizes, get_schedule
from megazero.core.spec_partition import partition_problems

RECOMPUTE = ("none", "selective", "full")
CP_METHODS = ("ring", "ulysses")
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")
PRECISIONS = ("bf16", "fp16", "fp32")


class PlanError(ValueError):
    """A layout, hardware or model the planner cannot plan; the message names the argument."""


@dataclass(frozen=True)
class Layout:
    """tp x pp x dp x cp ranks; each step is `global_batch` sequences in micro-batches of `micro_batch`.

    Context parallelism (``parallel.cp``, ``parallel.cp_method``; megazero/context_parallel): `cp` ranks hold
    s/cp tokens of every sequence each (a head and a tail chunk), attention sees the whole sequence by
    `cp_method` (ring: key/value blocks passed around the cp group; ulysses: all-to-alls between the sequence
    and the head split). The data is split over dp only (global_batch = micro_batch x micro-batches x dp); the
    parameters are replicated over cp, so gradients are reduced and ZeRO shards over dp x cp (`dp_cp`). Ranks
    are laid out pp, dp, cp, tp (outermost first): cp just outside tp, as `topology_of` puts it.

    zero: the ZeRO stage over dp (x cp) (0-3); recompute: activation recompute policy (none | selective:
    the attention core | full: segments of transformer blocks from their input), and under full the
    ``activation_checkpointing`` options: `every_k_layers` / `number_checkpoints` (the segments),
    `partition_activations` (a kept input split over the TP group, all-gathered for the recompute),
    `cpu_checkpointing` (kept in host memory), `contiguous_checkpoints` (contiguous_memory_optimization:
    kept in one preallocated buffer per stage); `schedule` may also be the path of a ``.csv`` schedule; schedule: a pipeline
    schedule, `chunks` model chunks per stage for the interleaved one; sequence_parallel: norms and
    dropout on sequence shards of the TP group (Korthikanti et al.); offload_optimizer: fp32 master
    and Adam moments in host memory; offload_param: stage-3 parameter shards in host memory. Bucket
    sizes in elements, as the ``zero.*`` config keys.

    Mixture of Experts (a spec with ``moe_num_experts``): `ep` expert-parallel ranks carved out of dp
    (``parallel.ep``: runs of ep consecutive dp ranks split each layer's routed experts, E / ep each; the
    dp / ep ranks holding the same experts reduce their gradients together); `expert_tp`
    (``parallel.expert_tp``): 1, every TP rank holds and runs whole experts, or tp, each expert's ffn
    dim split over the TP group with its outputs all-reduced (None: tp, Megatron's default; see
    `etp`); `moe_imbalance`: the busiest ep rank's received rows over the balanced k·b·s (>= 1; 1.0
    assumes balanced routing; capped by the capacity when the model sets a capacity factor).

    Communication options (comm_volume.py: their bytes; stage_costs.py: their time): `hierarchical`
    (``comm.hierarchical``): data-parallel reductions and gathers inside each node, then between nodes;
    `ranks_per_node` (``parallel.ranks_per_node``; None: the hardware's gpus_per_node); `onebit`
    (``optimizer.type: onebit_adam`` past its ``freeze_step`` warm-up, zero 0: the momentum averaged in
    1 bit instead of the gradient all-reduce); ZeRO++ at zero 3: `quantized_weights` (qwZ, int8
    gathers), `hpz` (``zero.hpz_partition_size``: the step's later gathers over hpz consecutive dp
    ranks; divides dp), `quantized_gradients` (qgZ, int8 reduce-scatter by all-to-all).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    global_batch: int = 1
    zero: int = 1
    recompute: str = "none"
    schedule: str = "1f1b"
    chunks: int = 1
    partition: str | tuple[int, ...] = "uniform"
    every_k_layers: int = 1
    number_checkpoints: int | None = None
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_checkpoints: bool = False
    sequence_parallel: bool = False
    offload_optimizer: bool = False
    offload_param: bool = False
    precision: str = "bf16"
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    overlap_comm: bool | None = None  # None: DeepSpeed's default, on at stage 3 only
    ep: int = 1
    expert_tp: int | None = None  # None: = tp
    moe_imbalance: float = 1.0
    hierarchical: bool = False
    ranks_per_node: int | None = None  # None: the hardware's gpus_per_node
    onebit: bool = False
    quantized_weights: bool = False
    hpz: int = 1
    quantized_gradients: bool = False
    cp: int = 1
    cp_method: str = "ring"

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def dp_cp(self) -> int:
        """The ranks holding the same parameters, dp x cp: what gradients are reduced over and ZeRO shards over
        (`ParallelContext.dp_cp_group`; the dp group itself when cp = 1)."""
        return self.dp * self.cp

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per pipeline flush on each data-parallel rank."""
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def virtual_stages(self) -> int:
        return self.pp * self.chunks

    @property
    def etp(self) -> int:
        """The TP size each expert's ffn dim is split over: `expert_tp`, or tp when None."""
        return self.tp if self.expert_tp is None else self.expert_tp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the dp ranks holding the same experts, dp / ep."""
        return self.dp // self.ep

    @property
    def edp_cp(self) -> int:
        """The ranks holding the same experts, (dp / ep) x cp: what expert gradients are reduced and ZeRO shards
        them over (`ParallelContext.edp_cp_group`; the edp group itself when cp = 1)."""
        return self.edp * self.cp

    @property
    def custom_schedule(self) -> bool:
        """A ``.csv`` schedule file (``pipeline.schedule``) rather than a built-in schedule."""
        return isinstance(self.schedule, str) and self.schedule.endswith(".csv")

    @property
    def checkpointing(self) -> SimpleNamespace:
        """The ``activation_checkpointing`` section this layout describes, under the config's names."""
        return SimpleNamespace(policy=self.recompute, every_k_layers=self.every_k_layers,
                               number_checkpoints=self.number_checkpoints,
                               partition_activations=self.partition_activations,
                               cpu_checkpointing=self.cpu_checkpointing,
                               contiguous_memory_optimization=self.contiguous_checkpoints,
                               synchronize_checkpoint_boundary=False, profile=False)

    @property
    def overlaps(self) -> bool:
        return self.zero == 3 if self.overlap_comm is None else self.overlap_comm

    def replace(self, **changes) -> "Layout":
        return replace(self, **changes)

    def describe(self) -> str:
        """One line: tp2 pp4 dp8 mb1 zero1 recompute=selective 1f1b (context parallel: cp16-ring after dp; MoE:
        ep4 after dp, expert-tp1 when it is not tp, imbalance=1.2 when not 1)."""
        sched = f"interleaved:{self.chunks}" if self.schedule == "interleaved" else self.schedule
        if self.partition != "uniform":
            part = self.partition if isinstance(self.partition, str) else ",".join(map(str, self.partition))
            sched += f" partition={part}"
        extras = [x for x, on in (("sp", self.sequence_parallel), ("offload-opt", self.offload_optimizer),
                                  ("offload-param", self.offload_param)) if on]
        extras += [x for x, on in ((f"every-{self.every_k_layers}-layers", self.every_k_layers != 1),
                                   (f"{self.number_checkpoints}-checkpoints", self.number_checkpoints is not None),
                                   ("partitioned-checkpoints", self.partition_activations),
                                   ("cpu-checkpoints", self.cpu_checkpointing),
                                   ("contiguous-checkpoints", self.contiguous_checkpoints)) if on]
        moe = [x for x, on in ((f"ep{self.ep}", self.ep != 1), (f"expert-tp{self.expert_tp}", self.etp != self.tp),
                               (f"imbalance={self.moe_imbalance:g}", self.moe_imbalance != 1.0)) if on]
        comm = [x for x, on in (("hierarchical", self.hierarchical),
                                (f"ranks-per-node={self.ranks_per_node}", self.ranks_per_node is not None),
                                ("onebit-adam", self.onebit), ("qwZ", self.quantized_weights),
                                (f"hpZ{self.hpz}", self.hpz != 1), ("qgZ", self.quantized_gradients)) if on]
        cp = [f"cp{self.cp}-{self.cp_method}"] if self.cp != 1 else []
        return " ".join([f"tp{self.tp} pp{self.pp} dp{self.dp}"] + cp + moe + [f"mb{self.micro_batch} zero{self.zero}",
                         f"recompute={self.recompute} {sched}"] + extras + comm)

    def problems(self, spec) -> list[str]:
        """Every reason this layout cannot run `spec` (a `megazero.core.spec.ModelSpec`), one line each."""
        errs = []
        for name in ("tp", "pp", "dp", "micro_batch", "global_batch", "chunks", "ep", "cp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                errs.append(f"{name}={v!r} must be a positive integer")
        if errs:
            return errs
        if self.zero not in (0, 1, 2, 3):
            errs.append(f"zero={self.zero!r} must be 0, 1, 2 or 3")
        if self.recompute not in RECOMPUTE:
            errs.append(f"recompute={self.recompute!r} is not one of {', '.join(RECOMPUTE)}")
        if self.schedule not in SCHEDULES and not self.custom_schedule:
            errs.append(f"schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)} (interleaved:V for V chunks) "
                        f"or the path of a .csv schedule")
        if self.precision not in PRECISIONS:
            errs.append(f"precision={self.precision!r} is not one of {', '.join(PRECISIONS)}")
        errs += checkpointing_problems(self.checkpointing, self.sequence_parallel)
        if self.offload_param and self.zero != 3:
            errs.append("offload_param needs zero=3")
        if self.offload_optimizer and self.zero == 0:
            errs.append("offload_optimizer needs zero 1, 2 or 3")
        if spec.heads % self.tp:
            errs.append(f"tp={self.tp} does not divide heads={spec.heads}")
        elif spec.num_kv_heads % self.tp:
            errs.append(f"tp={self.tp} does not divide kv_heads={spec.num_kv_heads}")
        if spec.ffn % self.tp:
            errs.append(f"tp={self.tp} does not divide ffn_hidden={spec.ffn}")
        errs += self._partition_problems(spec)
        if self.sequence_parallel and spec.seq_len % self.tp:
            errs.append(f"sequence_parallel needs seq_len={spec.seq_len} divisible by tp={self.tp}")
        errs += self._moe_problems(spec)
        errs += self._comm_problems()
        errs += self._cp_problems(spec)
        if self.global_batch % (self.micro_batch * self.dp):
            errs.append(f"global_batch={self.global_batch} is not divisible by micro_batch x dp = "
                        f"{self.micro_batch} x {self.dp}")
        elif self.schedule in SCHEDULES or self.custom_schedule:
            try:
                if self.custom_schedule:  # the file's stages, micro-batches and chunks must be the layout's
                    get_schedule(self.schedule, self.pp, self.num_microbatches, self.chunks)
                else:
                    check_sizes(self.schedule, self.pp, self.num_microbatches, self.chunks)
            except (ScheduleError, OSError, ValueError) as err:
                errs.append(str(err))
        return errs

    def _partition_problems(self, spec) -> list[str]:
        """The partition rules of config validation (`megazero.core.spec_partition.partition_problems`) and of
        the trainer's split of the layers (`stages.partition_bounds`: every virtual stage needs a layer)."""
        from megazero.planner.stages import partition_bounds  # stages.py imports this module (via layer_params)

        part = list(self.partition) if isinstance(self.partition, tuple) else self.partition
        errs = partition_problems(part, self.virtual_stages, spec.layers)
        if not errs:
            try:
                partition_bounds(spec, self)
            except ValueError as exc:
                errs.append(f"pipeline.partition: {exc}")
        return errs

    def _moe_problems(self, spec) -> list[str]:
        """The expert-parallel rules the runtime enforces (config validation, `MoESpec.check`,
        `ModelSpec.validate_layout`), and the planner's own on expert_tp and moe_imbalance."""
        moe, errs = getattr(spec, "moe", None), []
        if self.dp % self.ep:
            errs.append(f"ep={self.ep} does not divide dp={self.dp}: experts are split over ep of the dp ranks")
        if self.expert_tp not in (None, 1, self.tp):
            errs.append(f"expert_tp={self.expert_tp!r} must be 1 or tp={self.tp}")
        if isinstance(self.moe_imbalance, bool) or not isinstance(self.moe_imbalance, (int, float)) \
                or not self.moe_imbalance >= 1:
            errs.append(f"moe_imbalance={self.moe_imbalance!r} must be a number >= 1 (1: balanced routing)")
        if moe is None:
            if self.ep > 1:
                errs.append(f"ep={self.ep} needs a Mixture-of-Experts model (moe_num_experts > 0)")
            return errs
        if moe.num_experts % self.ep:
            errs.append(f"ep={self.ep} does not divide moe_num_experts={moe.num_experts}")
        if self.etp > 1:
            widths = [("moe_ffn", moe.ffn)] + ([("moe_shared_ffn", moe.shared_ffn or moe.ffn)]
                                               if moe.shared_experts else [])
            errs += [f"expert_tp={self.etp} does not divide {name}={n}" for name, n in widths if n % self.etp]
        if self.sequence_parallel and self.tp > 1:
            errs.append("sequence_parallel is not supported with Mixture-of-Experts layers (the router counts "
                        "capacity and losses per whole sequence)")
        return errs

    def _comm_problems(self) -> list[str]:
        """The rules the config enforces on the communication options (core/config/checks.py, validate.py)."""
        errs = []
        rpn = self.ranks_per_node
        if rpn is not None and (isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1 or self.gpus % rpn):
            errs.append(f"ranks_per_node={rpn!r} does not divide the world size {self.gpus}: nodes hold the same "
                        f"number of consecutive ranks")
        if self.onebit and self.zero != 0:
            errs.append(f"onebit (optimizer.type=onebit_adam) needs zero 0 (got {self.zero}): its ranks average the "
                        f"momentum of whole gradients, which stages 1-3 shard")
        zeropp = [k for k, on in (("quantized_weights", self.quantized_weights),
                                  ("quantized_gradients", self.quantized_gradients), ("hpz", self.hpz != 1)) if on]
        if zeropp and self.zero != 3:
            errs.append(f"{zeropp[0]}: ZeRO++ needs zero=3 (got {self.zero})")
        if isinstance(self.hpz, bool) or not isinstance(self.hpz, int) or self.hpz < 1:
            errs.append(f"hpz={self.hpz!r} must be a positive integer (1: off)")
        elif self.dp % self.hpz:
            errs.append(f"hpz={self.hpz} does not divide the data-parallel size dp={self.dp}: the secondary "
                        f"partition is over runs of that many dp ranks")
        return errs

    def _cp_problems(self, spec) -> list[str]:
        """What context parallelism refuses (`megazero.core.config.spec_checks._check_context_parallel`, config checks):
        a sequence that does not cut into 2·cp chunks (each split over tp again under sequence parallelism),
        Ulysses with heads per tp rank not a multiple of cp, dropout, an MoE capacity factor, ZeRO++ hpZ."""
        errs = []
        if self.cp_method not in CP_METHODS:
            errs.append(f"cp_method={self.cp_method!r} is not one of {', '.join(CP_METHODS)}")
        if self.cp == 1:
            return errs
        chunk = 2 * self.cp * (self.tp if self.sequence_parallel else 1)
        if spec.seq_len % chunk:
            errs.append(f"cp={self.cp} needs seq_len={spec.seq_len} divisible by 2 x cp"
                        + (" x tp (sequence parallel)" if self.sequence_parallel else "") + f" = {chunk}: each cp "
                        f"rank holds a head and a tail chunk of every sequence")
        if self.cp_method == "ulysses" and (spec.heads // self.tp) % self.cp:
            errs.append(f"cp_method=ulysses needs the {spec.heads // self.tp} heads per tp rank (heads={spec.heads} "
                        f"/ tp={self.tp}) divisible by cp={self.cp}; use cp_method=ring")
        if spec.dropout or spec.attention_dropout:
            errs.append(f"cp={self.cp} with dropout {max(spec.dropout, spec.attention_dropout)}: dropout masks are "
                        f"drawn per whole sequence, which no cp rank holds")
        moe = getattr(spec, "moe", None)
        if moe is not None and moe.capacity_factor is not None:
            errs.append(f"cp={self.cp} with moe_capacity_factor={moe.capacity_factor}: an expert's capacity is "
                        f"counted over each whole sequence, which no cp rank holds")
        if self.hpz != 1:
            errs.append(f"hpz={self.hpz} with cp={self.cp}: ZeRO++'s secondary partition is over dp ranks alone, "
                        f"not dp x cp")
        return errs

    def check(self, spec) -> None:
        """Raise `PlanError` with every problem of `problems(spec)`, one per line."""
        errs = self.problems(spec)
        if errs:
            raise PlanError(f"layout {self.describe()}: " + "; ".join(errs))
