"""The typed configuration schema: frozen dataclasses, one per section.

Library code receives these dataclasses (after `resolve`), never raw dicts. Field defaults follow
DeepSpeed's where DeepSpeed has the same knob, so a DeepSpeed JSON that omits a key means the same
thing here. ``None`` means "derived by `resolve`" unless a field's comment says otherwise.

String-valued choices are plain ``str`` fields checked by `validate` against the ``*_CHOICES``
tuples below (OmegaConf enums cannot hold names such as ``zb-h1``).

Model architecture (`ModelConfig`): the spec file (``model.spec``) defines the architecture; the
config may override fields of it. The common fields (layers, hidden, heads, kv_heads, ffn_hidden,
vocab, dropout, tie_embeddings) are typed ``Optional`` attributes, so ``model.layers=6`` is
type-checked and a typo such as ``model.layrs=6`` is an error naming ``model.layers``;
``None`` keeps the spec's value. Anything else a spec defines goes in the open dict
``model.overrides`` (``model.overrides.rope_theta=10000``), which the spec loader checks against
the spec's own fields. `ModelConfig.architecture()` merges both into one dict of overrides.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..checkpoint_rules import POLICIES

PRECISION_CHOICES = ("fp32", "bf16", "fp16")
AXIS_CHOICES = ("pp", "dp", "tp")
CP_METHODS = ("ring", "ulysses")
OFFLOAD_DEVICE_CHOICES = ("none", "cpu")
OPTIMIZER_CHOICES = ("adam", "adamw", "sgd", "onebit_adam")
SCHEDULER_CHOICES = ("constant", "linear", "cosine", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle")
WARMUP_TYPE_CHOICES = ("linear", "log")
CHECKPOINT_POLICY_CHOICES = POLICIES  # megazero/core/checkpoint_rules.py
"""Built-in pipeline schedules; a path ending in ``.csv`` names a custom schedule file."""
"""Named partition methods; ``type:<regex>`` and a list of per-stage layer counts are also valid."""
TOKENIZER_CHOICES = ("byte", "bpe")
BACKEND_CHOICES = ("auto", "gloo", "nccl")
NONFINITE_CHOICES = ("skip", "error", "ignore")
SILENT_ERROR_ACTIONS = ("stop", "skip", "warn")


@dataclass(frozen=True)
class ParallelConfig:
    """The PP x DP x CP x TP grid. ``dp`` is derived as world_size / (pp * cp * tp) when unset."""

    pp: int = 1
    tp: int = 1
    dp: Optional[int] = None
    cp: int = 1  # context parallel: each sequence's tokens split over cp ranks, attention over the whole sequence (megazero.context_parallel)
    cp_method: str = "ring"  # ring (key/value blocks passed around the cp group) | ulysses (all-to-alls: heads per tp rank divisible by cp)
    ep: int = 1  # expert parallel: experts split over ep of the dp ranks (ep divides dp)
    expert_tp: Optional[int] = None  # expert tensor parallel: experts' ffn split over 1 or tp ranks (None: tp)
    sequence_parallel: bool = False
    order: List[str] = field(default_factory=lambda: ["pp", "dp", "tp"])  # outermost first; cp, when not named, sits just outside tp
    ranks_per_node: Optional[int] = None  # consecutive ranks per node; None: the launcher's LOCAL_WORLD_SIZE


@dataclass(frozen=True)
class TrainConfig:
    """The batch triple obeys global_batch_size = micro_batch_size x gradient_accumulation_steps x dp.

    Any two derive the third; `resolve` fills the missing ones (see `validate.derive_batch`).
    gradient_accumulation_steps is also the number of micro-batches per pipeline flush.
    """

    micro_batch_size: Optional[int] = None
    gradient_accumulation_steps: Optional[int] = None
    global_batch_size: Optional[int] = None  # DeepSpeed train_batch_size
    steps: int = 100
    seed: int = 1234
    eval_interval: int = 0  # 0 = no evaluation
    eval_steps: int = 1


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-Experts overrides of the spec (`megazero.core.moe_spec.MoESpec`); unset keys keep
    the spec's. num_experts > 0 makes every block's MLP an MoE layer."""

    num_experts: Optional[int] = None
    top_k: Optional[int] = None
    ffn: Optional[int] = None  # each routed expert's hidden size (default: model.ffn_hidden)
    score: Optional[str] = None  # softmax | sigmoid
    normalize_topk: Optional[bool] = None
    capacity_factor: Optional[float] = None  # per-sequence capacity; unset in the spec: no dropping
    drop_tokens: Optional[bool] = None  # false: no dropping whatever the spec's capacity (DeepSpeed's name)
    aux_loss_coef: Optional[float] = None
    z_loss_coef: Optional[float] = None
    shared_experts: Optional[int] = None
    shared_ffn: Optional[int] = None


@dataclass(frozen=True)
class ModelConfig:
    """Which model to build and the architecture fields that override the spec's values."""

    spec: Optional[str] = None  # "model_specs/gpt.py:debug" (file[:flavor]) or "package.module:flavor"
    seq_len: Optional[int] = None  # training sequence length; None = the spec's
    layers: Optional[int] = None
    hidden: Optional[int] = None
    heads: Optional[int] = None
    kv_heads: Optional[int] = None
    ffn_hidden: Optional[int] = None
    vocab: Optional[int] = None
    dropout: Optional[float] = None
    tie_embeddings: Optional[bool] = None
    moe: MoEConfig = field(default_factory=MoEConfig)
    overrides: Dict[str, Any] = field(default_factory=dict)  # any other spec field, by name

    def architecture(self) -> dict[str, Any]:
        """Every architecture override: the typed fields that are set (model.moe.<key> as the spec's
        moe_<key>), then ``overrides``."""
        typed = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.name not in ("spec", "overrides", "moe") and getattr(self, f.name) is not None}
        moe = {f"moe_{f.name}": getattr(self.moe, f.name) for f in dataclasses.fields(self.moe)
               if getattr(self.moe, f.name) is not None and f.name != "drop_tokens"}
        if self.moe.drop_tokens is False:
            moe["moe_capacity_factor"] = None  # no capacity: every assignment kept
        return {**typed, **moe, **dict(self.overrides)}


@dataclass(frozen=True)
class DataConfig:
    path: Optional[str] = None  # None = synthetic random tokens (tests, benchmarks)
    packed_documents: bool = False  # attention within each document of a sample, positions restarting per document, the cross-document label ignored (Megatron's reset_attention_mask + reset_position_ids + eod_mask_loss)
    num_workers: int = 0
    tokenizer: str = "byte"


@dataclass(frozen=True)
class OffloadConfig:
    """Where ZeRO keeps a state: ``none`` (the accelerator) or ``cpu``.

    ``pin_memory``: the host buffers this offload puts on the CPU are page-locked, so the copies to and
    from the accelerator are asynchronous DMA; only when it is true *and* CUDA is available (pinning needs
    CUDA: on a CPU-only machine the buffers are ordinary memory whatever the key). True by default, as in
    DeepSpeed 0.19.8 (`DeepSpeedZeroOffloadOptimizerConfig.pin_memory`); false keeps the buffers pageable
    (the same values, host-blocking copies), for hosts with a tight ``ulimit -l``.
    """

    device: str = "none"
    pin_memory: bool = True


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO sharding over the dp axis. Sizes are element counts, as in DeepSpeed.

    ``None`` bucket sizes come from DeepSpeed's ``"auto"``: `resolve` sets them from model.hidden
    (h*h, 0.9*h*h, 10*h, as the Hugging Face integration does) or DeepSpeed's defaults.
    overlap_comm ``None`` resolves to DeepSpeed's default: true for stage 3 only.
    """

    stage: int = 0
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    overlap_comm: Optional[bool] = None
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    allgather_partitions: bool = True
    round_robin_gradients: bool = False
    reduce_bucket_size: Optional[int] = 500_000_000
    allgather_bucket_size: Optional[int] = 500_000_000
    prefetch_bucket_size: Optional[int] = 50_000_000  # DeepSpeed stage3_prefetch_bucket_size
    param_persistence_threshold: Optional[int] = 100_000  # DeepSpeed stage3_param_persistence_threshold
    sub_group_size: int = 1_000_000_000
    max_live_parameters: int = 1_000_000_000  # DeepSpeed stage3_max_live_parameters
    max_reuse_distance: int = 1_000_000_000  # DeepSpeed stage3_max_reuse_distance
    gather_16bit_weights_on_model_save: bool = False
    # ZeRO++ (stage 3; megazero.zero.zeropp): int8 weight all-gathers (qwZ), a secondary partition over
    # hpz_partition_size consecutive dp ranks for the step's later gathers (hpZ; 1 = off), int8 gradient
    # reduce-scatters (qgZ)
    quantized_weights: bool = False
    hpz_partition_size: int = 1
    quantized_gradients: bool = False


@dataclass(frozen=True)
class Fp16Config:
    """The loss scaler, used only with precision=fp16. loss_scale 0 = dynamic scaling."""

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0


@dataclass(frozen=True)
class OptimizerConfig:
    """adam/adamw/sgd/onebit_adam. adamw_mode (decoupled weight decay): None resolves to type == "adamw";
    a DeepSpeed ``"Adam"`` sets it true, as DeepSpeed does. onebit_adam (DeepSpeed's OneBitAdam,
    `megazero.zero.onebit`): `freeze_step` steps of Adam without bias correction, then the variance is
    frozen and the data-parallel ranks average their momentum in one bit per element (ZeRO stage 0)."""

    type: str = "adamw"
    lr: float = 1e-3
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0  # sgd only
    freeze_step: int = 100  # onebit_adam: full-precision Adam steps before the variance freezes and 1-bit starts
    bias_correction: bool = True  # Adam's bias corrections (a DeepSpeed OneBitAdam config: false, as it applies none)
    adamw_mode: Optional[bool] = None
    no_decay_1d: Optional[bool] = None  # Megatron's rule (no decay for biases, norms); None: megazero-built models only


@dataclass(frozen=True)
class SchedulerConfig:
    """Learning-rate schedule over optimizer steps; the peak is optimizer.lr (OneCycle: cycle_max_lr),
    or, for WarmupLR, WarmupDecayLR and WarmupCosineLR, each parameter group's own lr (optimizer.lr
    for the groups that set none) unless warmup_max_lr is set.

    constant: lr throughout (no warmup). linear / cosine (megazero's own): warmup from warmup_min_lr
    over warmup_steps (the last warmup step at lr), then linear / cosine decay to min_lr at
    total_steps; one lr for every group. total_steps None resolves to train.steps.

    DeepSpeed's WarmupLR and WarmupDecayLR (`megazero.zero.lr_schedule.deepspeed_warmup_lr`), step for
    step as DeepSpeed's (steps 0-based), for each parameter group: steps 0 and 1 at warmup_min_lr,
    then warmup by warmup_type over w = max(2, warmup_steps) steps (warmup_steps at least 1), reaching
    the peak at step w + 1 (log: at step w); WarmupLR then keeps the peak, WarmupDecayLR decays linearly
    back to warmup_min_lr (not min_lr, which they do not take), reached at step total_steps + 1 and kept
    after. The peak is warmup_max_lr (DeepSpeed's scheduler.params.warmup_max_lr) for every group when
    set, whatever the groups' lrs (from the first step on, as in DeepSpeed); None: each group's own lr
    at the start, as DeepSpeed's WarmupLR without warmup_max_lr. (DeepSpeed's WarmupDecayLR without
    warmup_max_lr peaks at 0.001: a DeepSpeed config gets warmup_max_lr=0.001 then.)

    DeepSpeed's WarmupCosineLR (`megazero.zero.lr_schedule.warmup_cosine_ratio`): a factor on each
    parameter group's own lr, 0 at the first step, warming up from warmup_min_ratio to 1 over
    warmup_steps (at least 1; DeepSpeed warms up over at least 2), then a half cosine down to
    cos_min_ratio at total_steps.

    DeepSpeed's OneCycle (`megazero.zero.lr_schedule.one_cycle_at`): one lr for every group, rising from
    cycle_min_lr to cycle_max_lr over cycle_first_step_size steps and back over cycle_second_step_size
    (None: the first), on cycle_*_stair_count levels (0: continuously; the second None: the first's),
    then, every decay_step_size steps (0: never), divided by 1 + decay_lr_rate per interval. With
    cycle_momentum, Adam's beta1 moves the other way between cycle_max_mom and cycle_min_mom (then
    times 1 + decay_mom_rate per interval) and beta2 is set to 0.99, as DeepSpeed's OneCycle does; SGD's
    momentum is not cycled, as in DeepSpeed. The defaults of these keys are DeepSpeed's.
    """

    type: str = "constant"
    warmup_steps: int = 0
    total_steps: Optional[int] = None
    min_lr: float = 0.0
    warmup_min_lr: float = 0.0
    warmup_type: str = "linear"  # DeepSpeed's WarmupLR default is "log"
    warmup_max_lr: Optional[float] = None  # WarmupLR, WarmupDecayLR: one peak for all groups; None: each group's lr
    warmup_min_ratio: float = 0.0  # WarmupCosineLR: the first warmup factor on each group's lr
    cos_min_ratio: float = 0.0001  # WarmupCosineLR: the final factor on each group's lr
    cycle_min_lr: Optional[float] = None  # OneCycle: lower bound of the lr (required)
    cycle_max_lr: Optional[float] = None  # OneCycle: upper bound of the lr (required)
    decay_lr_rate: float = 0.0
    cycle_first_step_size: int = 2000
    cycle_second_step_size: Optional[int] = None  # None: cycle_first_step_size
    cycle_first_stair_count: int = 0  # 0 (or below): continuous
    cycle_second_stair_count: Optional[int] = None  # None: cycle_first_stair_count
    decay_step_size: int = 0  # 0: no decay after the cycle
    cycle_momentum: bool = True
    cycle_min_mom: float = 0.8
    cycle_max_mom: float = 0.9
    decay_mom_rate: float = 0.0


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    policy: str = "none"
    every_k_layers: int = 1
    partition_activations: bool = False  # split saved layer inputs across the TP group
    cpu_checkpointing: bool = False  # needs partition_activations
    contiguous_memory_optimization: bool = False  # needs number_checkpoints
    number_checkpoints: Optional[int] = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


@dataclass(frozen=True)
class PipelineConfig:
    """schedule: a `megazero.core.schedules.SCHEDULES` name or a path ending in .csv. chunks: model chunks per stage
    (v, interleaved only). partition: a `megazero.core.partition.NAMED_METHODS` name, ``type:<regex>``, or a list with
    the number of transformer layers of each of the pp * chunks (virtual) stages, summing to model.layers (the
    embedding joins the first stage, the head the last; as Megatron's uneven first/last stages)."""

    schedule: str = "1f1b"
    chunks: int = 1
    partition: Any = "uniform"


@dataclass(frozen=True)
class CheckpointConfig:
    dir: Optional[str] = None  # None resolves to <run_dir>/checkpoints
    save_interval: int = 0  # 0 = never save
    load: Optional[str] = None  # start from this checkpoint (any layout) unless dir already has one to resume
    keep_last: int = 0  # keep the newest N complete checkpoints in dir; 0 = keep all
    async_save: bool = False  # copy to host memory, write in a background thread while training goes on
    save_on_failure: bool = False  # a failed step: each rank still alive writes its state, no collective (megazero.checkpoint.failure_save)


@dataclass(frozen=True)
class MonitorConfig:
    """A DeepSpeed monitor writing the engine's events (TensorBoard, CSV): `output_path`/`job_name`."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


@dataclass(frozen=True)
class WandbConfig:
    enabled: bool = False
    group: Optional[str] = None
    team: Optional[str] = None
    project: str = "deepspeed"


@dataclass(frozen=True)
class CommsLoggerConfig:
    """DeepSpeed's comms logger (`megazero.comm`): which calls are timed and what the summary adds."""

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: List[str] = field(default_factory=list)
    debug: bool = False


@dataclass(frozen=True)
class FlopsProfilerConfig:
    """DeepSpeed's flops profiler: one step (`profile_step`) counted and timed per module."""

    enabled: bool = False
    recompute_fwd_factor: float = 0.0
    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    output_file: Optional[str] = None


@dataclass(frozen=True)
class LogConfig:
    interval: int = 10  # DeepSpeed steps_per_print
    metrics_file: Optional[str] = None  # None resolves to <run_dir>/metrics.jsonl
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    all_ranks: bool = False
    progress_bar: bool = False
    peak_tflops: Optional[float] = None  # per device, for MFU; None = no MFU column
    tensorboard: MonitorConfig = field(default_factory=MonitorConfig)
    csv_monitor: MonitorConfig = field(default_factory=MonitorConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    comms_logger: CommsLoggerConfig = field(default_factory=CommsLoggerConfig)
    flops_profiler: FlopsProfilerConfig = field(default_factory=FlopsProfilerConfig)


@dataclass(frozen=True)
class TraceConfig:
    enabled: bool = False


@dataclass(frozen=True)
class CommConfig:
    timeout_s: int = 300
    backend: str = "auto"  # auto = nccl on CUDA, gloo otherwise
    hierarchical: bool = False  # data-parallel reductions and gathers inside each node first, then between nodes
    verify_order: bool = False  # every group's members compare each collective/p2p before issuing it (debugging; the tests' MEGAZERO_VERIFY_ORDER=1)


@dataclass(frozen=True)
class ResilienceConfig:
    """Weeks-long runs (docs/running-for-weeks.md): slow ranks named (`megazero.resilience.stragglers`), silent
    errors caught (`megazero.resilience.silent_check`). Both off by default; off, they cost nothing."""

    straggler_interval: int = 0  # every N steps gather each rank's step times over the world group and name consistently slow ranks; 0 = off
    straggler_ratio: float = 1.5  # slow at a step: compute above this factor times the median of the other ranks of its pipeline stage; a slow link: its transfer time above this factor times its axis's median
    link_probe_bytes: int = 4194304  # with straggler_interval: every window, time a ping-pong of this many bytes over each pp/dp/tp ring link and name slow links; 0 = no probe
    silent_error_interval: int = 0  # every N steps compute the step's gradients twice on the same data and compare; 0 = off
    silent_error_spike: float = 0.0  # also check a step whose loss exceeds this factor times the median of the last 20 steps; 0 = off
    silent_error_action: str = "stop"  # on a mismatch: stop (every rank, naming the ranks) | skip (no update, counted) | warn
    silent_error_rtol: float = 0.0  # 0 = bitwise; else the largest difference allowed, relative to the largest gradient


@dataclass(frozen=True)
class Config:
    """A whole run. `load_config` builds it; `resolve` fills every derived field."""

    name: Optional[str] = None  # None: the config file's stem, else "run"
    run_dir: Optional[str] = None  # None resolves to runs/<name>
    precision: str = "fp32"
    gradient_clipping: float = 0.0  # max global grad norm; 0 = off
    nonfinite_gradients: str = "skip"  # a step with inf/NaN gradients: skip (counted) | error | ignore (no check)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    fp16: Fp16Config = field(default_factory=Fp16Config)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)


@functools.cache  # a pure function of a class: resolving string annotations is most of a config load
def field_types(cls: type) -> typing.Mapping[str, Any]:
    """The resolved type annotation of each field of dataclass `cls`, in declaration order (read-only)."""
    hints = typing.get_type_hints(cls)
    return types.MappingProxyType({f.name: hints[f.name] for f in dataclasses.fields(cls)})


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, sections included (``"zero"``, ``"zero.stage"``, ...)."""
    keys = []
    for name, tp in field_types(cls).items():
        key = prefix + name
        keys.append(key)
        if dataclasses.is_dataclass(tp):
            keys.extend(all_keys(tp, key + "."))
    return keys


def get_key(cfg: Any, dotted: str) -> Any:
    """The value at dotted key `dotted` of a config dataclass (``get_key(cfg, "zero.stage")``)."""
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value
