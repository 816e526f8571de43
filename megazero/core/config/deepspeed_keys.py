"""Every DeepSpeed JSON key megazero recognises, and what it becomes.

A key not in this table is an error naming the closest key that is. A key with no megazero
counterpart is accepted only for the values at which it is truly a no-op for megazero (column
"no-op when"); any other value raises ``ConfigError("<key>=<value>: not supported yet ...")``. Each scheduler.type
takes only its own scheduler.params (`SCHEDULER_PARAMS`, its DeepSpeed class's arguments; DeepSpeed
fails on any other), and another is an error naming the key and the type's parameters.

| DeepSpeed key | megazero key | note |
|---|---|---|
| train_batch_size | train.global_batch_size | "auto": derived from the other two and dp |
| train_micro_batch_size_per_gpu | train.micro_batch_size | "auto": derived |
| gradient_accumulation_steps | train.gradient_accumulation_steps | "auto": derived |
| gradient_clipping | gradient_clipping | DeepSpeed's default 1.0 when absent (megazero's own default is 0 = off) |
| steps_per_print | log.interval | |
| wall_clock_breakdown | log.wall_clock_breakdown | |
| memory_breakdown | log.memory_breakdown | |
| fp16.enabled, bf16.enabled (bfloat16.enabled) | precision | both true is an error; "auto" is an error |
| fp16.loss_scale, initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale | fp16.* | read only when fp16.enabled; DeepSpeed ignores them otherwise |
| fp16.auto_cast | - | no-op for any value: it casts floating-point model inputs, and megazero's inputs are token ids |
| fp16.fp16_master_weights_and_grads | - | no-op when false |
| optimizer.type | optimizer.type | Adam, AdamW, SGD, OneBitAdam (any case); Adam sets optimizer.adamw_mode=true as DeepSpeed does |
| optimizer.params.freeze_step | optimizer.freeze_step | OneBitAdam: Adam steps before the 1-bit momentum average |
| optimizer.params.cuda_aware, comm_backend_name | - | OneBitAdam: no-op when false / "nccl" (megazero averages over the data-parallel group's own backend; DeepSpeed's MPI and compressed backends are not supported) |
| optimizer.params.lr, betas, eps, weight_decay, momentum | optimizer.* | "auto" is an error |
| optimizer.params.adam_w_mode | optimizer.adamw_mode | |
| optimizer.params.torch_adam | - | no-op for any value: it picks DeepSpeed's kernel; the update is the same Adam |
| optimizer.params.amsgrad / nesterov / dampening | - | no-op when false / false / 0 |
| optimizer.params.bias_correction | optimizer.bias_correction | OneBitAdam: always false (DeepSpeed's applies no bias correction, whatever the key) |
| optimizer.legacy_fusion | - | no-op when false |
| scheduler.type | scheduler.type | WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle; LRRangeTest is not supported yet |
| scheduler.params.warmup_min_lr | scheduler.warmup_min_lr | WarmupLR, WarmupDecayLR |
| scheduler.params.warmup_max_lr | scheduler.warmup_max_lr | WarmupLR, WarmupDecayLR: the peak of every parameter group, whatever optimizer.params.lr and the groups' lrs (as in DeepSpeed, the scheduler sets every group's lr from the first step); unset: WarmupLR peaks at each group's own lr, WarmupDecayLR at DeepSpeed's default 0.001 |
| scheduler.params.warmup_num_steps | scheduler.warmup_steps | DeepSpeed's default 1000 when absent (not OneCycle) |
| scheduler.params.total_num_steps | scheduler.total_steps | required by WarmupDecayLR and WarmupCosineLR |
| scheduler.params.warmup_type | scheduler.warmup_type | DeepSpeed's default "log" when absent (not OneCycle) |
| scheduler.params.warmup_min_ratio, cos_min_ratio | scheduler.warmup_min_ratio, cos_min_ratio | WarmupCosineLR: factors on each parameter group's own lr; DeepSpeed's defaults 0 and 0.0001 when absent |
| scheduler.params.cycle_min_lr, cycle_max_lr | scheduler.cycle_min_lr, cycle_max_lr | OneCycle: required; numbers (DeepSpeed's per-group lists are not supported yet) |
| scheduler.params.decay_lr_rate, cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count, cycle_second_stair_count, decay_step_size | scheduler.* (same names) | OneCycle; DeepSpeed's defaults 0, 2000, null (= first), 0, null (= first), 0 when absent |
| scheduler.params.cycle_momentum, cycle_min_mom, cycle_max_mom, decay_mom_rate | scheduler.* (same names) | OneCycle: Adam's betas become (momentum, 0.99) as in DeepSpeed; DeepSpeed's defaults true, 0.8, 0.9, 0 when absent |
| scheduler.params.last_batch_iteration | - | no-op when -1 |
| scheduler.params.lr_range_test_min_lr, lr_range_test_step_size, lr_range_test_step_rate, lr_range_test_staircase | - | LRRangeTest's: the error names scheduler.type=LRRangeTest, not supported yet |
| zero_optimization (true/false) | zero.stage | the deprecated boolean form: true = stage 1 |
| zero_optimization.stage | zero.stage | |
| zero_optimization.overlap_comm, contiguous_gradients, reduce_scatter, allgather_partitions, round_robin_gradients, sub_group_size | zero.* | |
| zero_optimization.reduce_bucket_size, allgather_bucket_size | zero.* | "auto": from model.hidden or DeepSpeed's default (see ZeroConfig) |
| zero_optimization.stage3_prefetch_bucket_size | zero.prefetch_bucket_size | "auto" as above |
| zero_optimization.stage3_param_persistence_threshold | zero.param_persistence_threshold | "auto" as above |
| zero_optimization.stage3_max_live_parameters, stage3_max_reuse_distance | zero.max_live_parameters, zero.max_reuse_distance | |
| zero_optimization.stage3_gather_16bit_weights_on_model_save (stage3_gather_fp16_weights_on_model_save) | zero.gather_16bit_weights_on_model_save | |
| zero_optimization.offload_optimizer.device, pin_memory | zero.offload_optimizer.* | device nvme is not supported yet; pin_memory true by default, as DeepSpeed's |
| zero_optimization.offload_param.device, pin_memory | zero.offload_param.* | device nvme is not supported yet; pin_memory true by default, as DeepSpeed's |
| zero_optimization.offload_*.nvme_path, buffer_count, buffer_size, max_in_cpu, pipeline_read, pipeline_write, fast_init | - | no-op for any value: used only with device nvme, which megazero rejects |
| zero_optimization.offload_optimizer.ratio | - | no-op when 1.0 (the whole optimizer offloaded) |
| zero_optimization.cpu_offload, cpu_offload_param, cpu_offload_use_pin_memory | zero.offload_*.device / pin_memory | deprecated DeepSpeed spellings; cpu_offload(_param) false = no offload; cpu_offload_use_pin_memory sets both pin_memory keys (DeepSpeed ignores it); the new spelling wins |
| zero_optimization.ignore_unused_parameters | - | no-op when true (megazero never checks for unused parameters) |
| zero_optimization.elastic_checkpoint, legacy_stage1 | - | no-op when false (feature off) |
| zero_optimization.memory_efficient_linear | - | no-op for any value: a DeepSpeed-internal ZeRO-3 linear implementation |
| zero_optimization.zero_quantized_weights, zero_hpz_partition_size, zero_quantized_gradients | zero.quantized_weights, hpz_partition_size, quantized_gradients | ZeRO++ (stage 3): int8 weight gathers, the secondary partition, int8 gradient reduce-scatters |
| zero_optimization.zero_quantized_nontrainable_weights, mics_hierarchical_params_gather, stage3_use_all_reduce_for_fetch_params, stage3_allgather_sequential | - | no-op when false |
| zero_optimization.mics_shard_size | - | no-op when -1 |
| zero_optimization.stage3_module_granularity_threshold | - | no-op when 0 |
| zero_optimization.load_from_fp32_weights, use_multi_rank_bucket_allreduce, stage3_model_persistence_threshold, zeropp_loco_param | - | not supported yet (any value) |
| activation_checkpointing.partition_activations, cpu_checkpointing, contiguous_memory_optimization, number_checkpoints, synchronize_checkpoint_boundary, profile | activation_checkpointing.* | they configure checkpointing; turn it on with activation_checkpointing.policy |
| data_types.grad_accum_dtype | - | no-op when "fp32" (megazero accumulates gradients in fp32 buffers) |
| communication_data_type | - | no-op when null |
| prescale_gradients / gradient_predivide_factor | - | no-op when false / 1.0 |
| sparse_gradients, dump_state | - | no-op when false |
| zero_allow_untested_optimizer, zero_force_ds_cpu_optimizer | - | no-op for any value (megazero has no such gate; offload always uses its CPU Adam) |
| aio | - | no-op for any value: NVMe I/O settings |
| checkpoint.tag_validation | - | no-op when "Ignore" |
| checkpoint.load_universal, use_node_local_storage | - | no-op when false |
| tensorboard / csv_monitor .enabled, output_path, job_name; wandb.enabled, group, team, project | log.tensorboard.*, log.csv_monitor.*, log.wandb.* (same keys) | the engine's monitors (`megazero.compat.monitor`) |
| comms_logger.enabled, verbose, prof_all, prof_ops, debug | log.comms_logger.* | `megazero.comm`'s logger, with the engine's collectives in its summary |
| flops_profiler.enabled, recompute_fwd_factor, profile_step, module_depth, top_modules, detailed, output_file | log.flops_profiler.* | `megazero.compat.flops_profiler` |
| comet, autotuning, elasticity, curriculum_learning, data_efficiency, compression_training, progressive_layer_drop, eigenvalue, quantize_training, nebula, amp | - | no-op when {"enabled": false}; otherwise not supported yet |
| pipeline.stages | parallel.pp | "auto" (DeepSpeed's default): the PipelineModule's num_stages |
| pipeline.partition | pipeline.partition | parameters, uniform, type:<regex> (DeepSpeed's methods) |
| pipeline.seed_layers / activation_checkpoint_interval | - | no-op when false / 0 (the interval is PipelineModule's argument) |
| pipeline.pipe_partitioned, grad_partitioned, use_reentrant | - | no-op for any value: how activations travel, not what they are |
| sparse_attention, bf16.immediate_grad_update, bf16.check_grad_overflow | - | not supported yet (any value) |
| expert_parallel.enabled | - | DeepSpeed's AutoEP; the other expert_parallel keys are read only when it is true (as DeepSpeed) |
| expert_parallel.autoep_size | parallel.ep | the experts split over this many of the data-parallel ranks |
| expert_parallel.expert_tensor_parallel_size | parallel.expert_tp | DeepSpeed's default 1 when absent (megazero's own default is the TP size) |
| expert_parallel.top_k, score_func, route_norm | model.moe.top_k, score, normalize_topk | "auto" / null: the model's own |
| expert_parallel.route_scale, routed_scaling_factor | - | no-op when 1.0 (routed_scaling_factor also "auto") |
| expert_parallel.score_apply | - | no-op when "auto" or "post" (the weights scale the experts' outputs, as megazero's MoE layer) |
| expert_parallel.load_balance_coeff | - | no-op when null (DeepSpeed refuses any other value; megazero's is model.moe.aux_loss_coef) |
| expert_parallel.num_expert_groups, num_limited_groups | - | no-op when null (group-limited routing) |
| expert_parallel.comm_backend | - | no-op when "comm" (DeepEP is not supported yet) |
| expert_parallel.preset_model, moe_layer_pattern, expert_pattern, router_pattern, expert_w1, expert_w2, expert_w3, num_experts_attr, top_k_attr, has_shared_experts, shared_experts_pattern, shared_experts_gate_pattern, expert_activation | - | no-op for any value: how DeepSpeed finds a Hugging Face model's MoE blocks; megazero's come from model.moe and the spec |
| expert_parallel.use_grouped_mm, disable_triton_grouped_mm, gate_up_impl, combine_impl, row_weighting_impl, async_split_plan, validate_folding_routing, comm_num_sm, comm_qp_margin, comm_max_tokens_per_rank | - | no-op for any value: kernel and overlap choices, not what is computed |
| use_data_before_expert_parallel_ | - | no-op when false (megazero's expert groups are consecutive data-parallel ranks, DeepSpeed's default) |
| sequence_parallel_size | parallel.cp, with parallel.cp_method=ulysses | DeepSpeed-Ulysses (ALST): each sequence split over this many ranks, attention by all-to-alls; megazero runs it in its own attention, so the model must be a megazero spec |
| data_parallel_size | parallel.dp | DeepSpeed's mesh with sequence_parallel_size |
| seq_parallel_communication_data_type | - | no-op when "fp32" or null (megazero reduces gradients over dp x cp in fp32; the all-to-alls move the compute dtype) |
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, NamedTuple, Optional

SPECIAL = "<special>"
"""Target of keys that `deepspeed.translate` handles in code (precision, optimizer/scheduler type)."""


class Rule(NamedTuple):
    """One DeepSpeed key: where it goes, or for which values it is a true no-op."""

    ds: str  # dotted DeepSpeed key
    target: Optional[str]  # dotted megazero key, SPECIAL, or None (no counterpart)
    noop: Callable[[Any], bool] = lambda v: False  # target None: values that are no-ops
    auto: bool = False  # "auto" allowed: becomes None (derived by resolve)
    note: str = ""


def _any(v: Any) -> bool:
    return True


def _off(v: Any) -> bool:
    return v is False


def _disabled_section(v: Any) -> bool:
    return isinstance(v, dict) and v.get("enabled") is False


_Z = "zero_optimization."
_OO = _Z + "offload_optimizer."
_OP = _Z + "offload_param."
_NVME = "used only with device nvme"
_EP = "expert_parallel."

RULES: tuple[Rule, ...] = (
    Rule("train_batch_size", "train.global_batch_size", auto=True),
    Rule("train_micro_batch_size_per_gpu", "train.micro_batch_size", auto=True),
    Rule("gradient_accumulation_steps", "train.gradient_accumulation_steps", auto=True),
    Rule("gradient_clipping", "gradient_clipping"),
    Rule("steps_per_print", "log.interval"),
    Rule("wall_clock_breakdown", "log.wall_clock_breakdown"),
    Rule("memory_breakdown", "log.memory_breakdown"),
    # precision
    Rule("fp16.enabled", SPECIAL), Rule("bf16.enabled", SPECIAL), Rule("bfloat16.enabled", SPECIAL),
    Rule("fp16.loss_scale", "fp16.loss_scale"),
    Rule("fp16.initial_scale_power", "fp16.initial_scale_power"),
    Rule("fp16.loss_scale_window", "fp16.loss_scale_window"),
    Rule("fp16.hysteresis", "fp16.hysteresis"),
    Rule("fp16.consecutive_hysteresis", "fp16.consecutive_hysteresis"),
    Rule("fp16.min_loss_scale", "fp16.min_loss_scale"),
    Rule("fp16.auto_cast", None, _any, note="casts floating inputs; megazero's are token ids"),
    Rule("fp16.fp16_master_weights_and_grads", None, _off, note="fp16 master weights"),
    Rule("bf16.immediate_grad_update", None, note="bf16 optimizer variants"),
    Rule("bf16.check_grad_overflow", None, note="bf16 optimizer variants"),
    # optimizer
    Rule("optimizer.type", SPECIAL),
    Rule("optimizer.legacy_fusion", None, _off, note="legacy fused optimizer"),
    Rule("optimizer.params.lr", "optimizer.lr"),
    Rule("optimizer.params.betas", "optimizer.betas"),
    Rule("optimizer.params.eps", "optimizer.eps"),
    Rule("optimizer.params.weight_decay", "optimizer.weight_decay"),
    Rule("optimizer.params.momentum", "optimizer.momentum"),
    Rule("optimizer.params.adam_w_mode", "optimizer.adamw_mode"),
    Rule("optimizer.params.freeze_step", "optimizer.freeze_step"),
    Rule("optimizer.params.cuda_aware", None, _off, note="CUDA-aware MPI: megazero's 1-bit average runs over the "
         "torch.distributed data-parallel group"),
    Rule("optimizer.params.comm_backend_name", None, lambda v: v == "nccl", note="megazero's 1-bit average runs "
         "over the data-parallel group's own backend (NCCL on GPUs); DeepSpeed's MPI and compressed backends"),
    Rule("optimizer.params.torch_adam", None, _any, note="kernel choice"),
    Rule("optimizer.params.amsgrad", None, _off, note="AMSGrad"),
    Rule("optimizer.params.nesterov", None, _off, note="Nesterov momentum"),
    Rule("optimizer.params.dampening", None, lambda v: v == 0, note="SGD dampening"),
    Rule("optimizer.params.bias_correction", "optimizer.bias_correction"),
    # scheduler
    Rule("scheduler.type", SPECIAL),
    Rule("scheduler.params.warmup_min_lr", "scheduler.warmup_min_lr"),
    Rule("scheduler.params.warmup_max_lr", "scheduler.warmup_max_lr"),
    Rule("scheduler.params.warmup_num_steps", "scheduler.warmup_steps"),
    Rule("scheduler.params.total_num_steps", "scheduler.total_steps"),
    Rule("scheduler.params.warmup_type", "scheduler.warmup_type"),
    Rule("scheduler.params.last_batch_iteration", None, lambda v: v == -1, note="resuming a schedule by index"),
    *(Rule("scheduler.params." + k, "scheduler." + k) for k in ("warmup_min_ratio", "cos_min_ratio")),
    *(Rule("scheduler.params." + k, "scheduler." + k) for k in (
        "cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
        "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_momentum",
        "cycle_min_mom", "cycle_max_mom", "decay_mom_rate")),
    *(Rule("scheduler.params." + k, SPECIAL, note="LRRangeTest (not supported yet)") for k in (
        "lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate", "lr_range_test_staircase")),
    # ZeRO
    Rule(_Z + "stage", "zero.stage"),
    Rule(_Z + "overlap_comm", "zero.overlap_comm"),
    Rule(_Z + "contiguous_gradients", "zero.contiguous_gradients"),
    Rule(_Z + "reduce_scatter", "zero.reduce_scatter"),
    Rule(_Z + "allgather_partitions", "zero.allgather_partitions"),
    Rule(_Z + "round_robin_gradients", "zero.round_robin_gradients"),
    Rule(_Z + "sub_group_size", "zero.sub_group_size"),
    Rule(_Z + "reduce_bucket_size", "zero.reduce_bucket_size", auto=True),
    Rule(_Z + "allgather_bucket_size", "zero.allgather_bucket_size", auto=True),
    Rule(_Z + "stage3_prefetch_bucket_size", "zero.prefetch_bucket_size", auto=True),
    Rule(_Z + "stage3_param_persistence_threshold", "zero.param_persistence_threshold", auto=True),
    Rule(_Z + "stage3_max_live_parameters", "zero.max_live_parameters"),
    Rule(_Z + "stage3_max_reuse_distance", "zero.max_reuse_distance"),
    Rule(_Z + "stage3_gather_16bit_weights_on_model_save", "zero.gather_16bit_weights_on_model_save"),
    Rule(_Z + "stage3_gather_fp16_weights_on_model_save", "zero.gather_16bit_weights_on_model_save"),
    Rule(_OO + "device", "zero.offload_optimizer.device"),
    Rule(_OO + "pin_memory", "zero.offload_optimizer.pin_memory"),
    Rule(_OP + "device", "zero.offload_param.device"),
    Rule(_OP + "pin_memory", "zero.offload_param.pin_memory"),
    *(Rule(_OO + k, None, _any, note=_NVME) for k in
      ("nvme_path", "buffer_count", "pipeline_read", "pipeline_write", "fast_init")),
    *(Rule(_OP + k, None, _any, note=_NVME) for k in ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu")),
    Rule(_OO + "ratio", None, lambda v: v == 1, note="partial optimizer offload"),
    Rule(_Z + "cpu_offload", SPECIAL), Rule(_Z + "cpu_offload_param", SPECIAL),
    Rule(_Z + "cpu_offload_use_pin_memory", SPECIAL),
    Rule(_Z + "ignore_unused_parameters", None, lambda v: v is True, note="erroring on unused parameters"),
    Rule(_Z + "elastic_checkpoint", None, _off, note="elastic checkpoints"),
    Rule(_Z + "legacy_stage1", None, _off, note="legacy stage 1"),
    Rule(_Z + "memory_efficient_linear", None, _any, note="DeepSpeed-internal implementation"),
    Rule(_Z + "zero_hpz_partition_size", "zero.hpz_partition_size"),
    Rule(_Z + "zero_quantized_weights", "zero.quantized_weights"),
    Rule(_Z + "zero_quantized_gradients", "zero.quantized_gradients"),
    *(Rule(_Z + k, None, _off, note="ZeRO++ / MiCS / stage-3 fetch variants") for k in (
        "zero_quantized_nontrainable_weights",
        "mics_hierarchical_params_gather", "stage3_use_all_reduce_for_fetch_params",
        "stage3_allgather_sequential")),
    Rule(_Z + "mics_shard_size", None, lambda v: v == -1, note="MiCS sharding"),
    Rule(_Z + "stage3_module_granularity_threshold", None, lambda v: v == 0, note="module-granular fetch"),
    *(Rule(_Z + k, None, note="no megazero counterpart yet") for k in (
        "load_from_fp32_weights", "use_multi_rank_bucket_allreduce", "stage3_model_persistence_threshold",
        "zeropp_loco_param")),
    # activation checkpointing
    *(Rule("activation_checkpointing." + k, "activation_checkpointing." + k) for k in (
        "partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
        "number_checkpoints", "synchronize_checkpoint_boundary", "profile")),
    # everything else users commonly write
    Rule("data_types.grad_accum_dtype", None, lambda v: v == "fp32", note="non-fp32 gradient accumulation"),
    Rule("communication_data_type", None, lambda v: v is None, note="reduced-precision communication"),
    Rule("prescale_gradients", None, _off, note="averaging before the reduction"),
    Rule("gradient_predivide_factor", None, lambda v: v == 1, note="gradient pre-division"),
    Rule("sparse_gradients", None, _off, note="sparse embedding gradients"),
    Rule("dump_state", None, _off, note="state dumps"),
    Rule("zero_allow_untested_optimizer", None, _any, note="optimizer gate"),
    Rule("zero_force_ds_cpu_optimizer", None, _any, note="optimizer gate"),
    Rule("aio", None, _any, note="NVMe I/O settings"),
    Rule("checkpoint.tag_validation", None, lambda v: v == "Ignore", note="checkpoint tag validation"),
    Rule("checkpoint.load_universal", None, _off, note="universal checkpoints"),
    Rule("checkpoint.use_node_local_storage", None, _off, note="node-local checkpoint storage"),
    *(Rule(f"{section}.{k}", f"log.{section}.{k}") for section, keys in (
        ("tensorboard", ("enabled", "output_path", "job_name")), ("csv_monitor", ("enabled", "output_path", "job_name")),
        ("wandb", ("enabled", "group", "team", "project")),
        ("comms_logger", ("enabled", "verbose", "prof_all", "prof_ops", "debug")),
        ("flops_profiler", ("enabled", "recompute_fwd_factor", "profile_step", "module_depth", "top_modules",
                            "detailed", "output_file"))) for k in keys),
    *(Rule(k, None, _disabled_section, note="this DeepSpeed feature") for k in (
        "comet", "autotuning",
        "elasticity", "curriculum_learning", "data_efficiency", "compression_training",
        "progressive_layer_drop", "eigenvalue", "quantize_training", "nebula", "amp")),
    # DeepSpeed's pipeline section (the PipelineModule's num_stages decides the pipeline size when
    # stages is "auto", which megazero.initialize applies)
    Rule("pipeline.stages", "parallel.pp", auto=True),
    Rule("pipeline.partition", "pipeline.partition"),
    Rule("pipeline.seed_layers", None, _off, note="per-layer seeds; megazero's layers draw from the model seed"),
    Rule("pipeline.activation_checkpoint_interval", None, lambda v: v == 0,
         note="pass PipelineModule(activation_checkpoint_interval=...), as DeepSpeed reads it from there"),
    *(Rule("pipeline." + k, None, _any, note="how activations travel, not what they are") for k in (
        "pipe_partitioned", "grad_partitioned", "use_reentrant")),
    Rule("sparse_attention", None, note="sparse attention"),
    # DeepSpeed's AutoEP (expert parallelism): read only when expert_parallel.enabled is true
    Rule(_EP + "enabled", SPECIAL),
    Rule(_EP + "autoep_size", "parallel.ep"),
    Rule(_EP + "expert_tensor_parallel_size", "parallel.expert_tp"),
    Rule(_EP + "top_k", "model.moe.top_k", auto=True),
    Rule(_EP + "score_func", "model.moe.score", auto=True),
    Rule(_EP + "route_norm", "model.moe.normalize_topk"),
    Rule(_EP + "route_scale", None, lambda v: v == 1, note="scaling the routed output"),
    Rule(_EP + "routed_scaling_factor", None, lambda v: v is None or v == 1, auto=True,
         note="scaling the routed output"),
    Rule(_EP + "load_balance_coeff", None, lambda v: v is None, note="DeepSpeed refuses it too; megazero's is "
         "model.moe.aux_loss_coef"),
    *(Rule(_EP + k, None, lambda v: v is None, note="group-limited routing") for k in (
        "num_expert_groups", "num_limited_groups")),
    Rule(_EP + "comm_backend", None, lambda v: v == "comm", note="DeepEP"),
    *(Rule(_EP + k, None, _any, note="how DeepSpeed finds a Hugging Face model's MoE blocks") for k in (
        "preset_model", "moe_layer_pattern", "expert_pattern", "router_pattern", "expert_w1", "expert_w2",
        "expert_w3", "num_experts_attr", "top_k_attr", "has_shared_experts", "shared_experts_pattern",
        "shared_experts_gate_pattern", "expert_activation")),
    Rule(_EP + "score_apply", None, lambda v: v in (None, "post"), auto=True,
         note="weighting the experts' inputs instead of their outputs"),
    *(Rule(_EP + k, None, _any, auto=True, note="kernel and overlap choices") for k in (
        "use_grouped_mm", "disable_triton_grouped_mm", "gate_up_impl", "combine_impl", "row_weighting_impl",
        "async_split_plan", "validate_folding_routing", "comm_num_sm", "comm_qp_margin", "comm_max_tokens_per_rank")),
    Rule("use_data_before_expert_parallel_", None, _off, note="data-parallel-major expert groups"),
    # DeepSpeed-Ulysses (sequence parallelism over a mesh of data_parallel_size x sequence_parallel_size)
    Rule("sequence_parallel_size", "parallel.cp"),
    Rule("data_parallel_size", "parallel.dp"),
    Rule("seq_parallel_communication_data_type", None, lambda v: v in (None, "fp32"),
         note="16-bit gradient reductions over the sequence-parallel ranks; megazero's are fp32"),
)

DICT_SECTIONS = ("zero_optimization", _Z + "offload_optimizer", _Z + "offload_param", "fp16", "bf16",
                 "bfloat16", "optimizer", "optimizer.params", "scheduler", "scheduler.params",
                 "activation_checkpointing", "data_types", "checkpoint", "pipeline", "expert_parallel",
                 "tensorboard", "csv_monitor", "wandb", "comms_logger", "flops_profiler")
"""DeepSpeed keys whose values are sections (mappings) of further keys."""

OPTIMIZER_TYPES = MappingProxyType({"adam": "adam", "adamw": "adamw", "sgd": "sgd", "onebitadam": "onebit_adam"})
OTHER_DS_OPTIMIZERS = ("zerooneadam", "onebitlamb", "lamb", "adagrad", "lion",
                       "muadam", "muadamw", "musgd", "muon", "cpuadam", "fusedadam")
SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle")
OTHER_DS_SCHEDULERS = ("LRRangeTest",)
_WARMUP = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration")
SCHEDULER_PARAMS = MappingProxyType({
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": ("total_num_steps",) + _WARMUP,
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                       "last_batch_iteration"),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
                 "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_momentum",
                 "cycle_min_mom", "cycle_max_mom", "decay_mom_rate", "last_batch_iteration"),
})
"""The scheduler.params keys each DeepSpeed scheduler type takes (its class's arguments)."""
