"""Typed configuration (L0: pure, imports neither torch nor torch.distributed).

    cfg = load_config("configs/debug_gpt.yaml", ["model.layers=6"], world_size=8)
    assert_supported(cfg)          # the trainer refuses features not implemented yet
    cfg.parallel.dp, cfg.train.global_batch_size, cfg.zero.stage   # dataclasses, never dicts

Sources: YAML or JSON in megazero's schema (`schema.Config`), DeepSpeed JSON (`deepspeed`, key
table in `deepspeed_keys`), ``key=value`` overrides. `validate` runs before any process group
exists; `resolve` derives dp = world / (pp x tp) and the batch triple
global = micro x grad_accum x dp. ``python -m megazero.core.config explain CONFIG [key=value ...]
--world-size N`` prints the resolved config and the derived values.
"""
from .deepspeed import from_deepspeed, is_deepspeed, translate
from .errors import ConfigError
from .explain import derived_values, explain
from .loading import load_config, parse_overrides, read_file, read_tree
from .schema import (ActivationCheckpointingConfig, CheckpointConfig, CommConfig, Config, DataConfig,
                     Fp16Config, LogConfig, ModelConfig, OffloadConfig, OptimizerConfig, ParallelConfig,
                     PipelineConfig, SchedulerConfig, TraceConfig, TrainConfig, ZeroConfig, all_keys, get_key)
from .supported import NOT_SUPPORTED, Unsupported, assert_supported, unsupported
from .tree import build_config, check_tree, to_dict, to_yaml
from .validate import derive_batch, layout_dp, resolve, topology_of, validate

__all__ = [
    "ActivationCheckpointingConfig", "CheckpointConfig", "CommConfig", "Config", "ConfigError", "DataConfig",
    "Fp16Config", "LogConfig", "ModelConfig", "NOT_SUPPORTED", "OffloadConfig", "OptimizerConfig",
    "ParallelConfig", "PipelineConfig", "SchedulerConfig", "TraceConfig", "TrainConfig", "Unsupported",
    "ZeroConfig", "all_keys", "assert_supported", "build_config", "check_tree",
    "derive_batch", "derived_values", "explain", "from_deepspeed", "get_key", "is_deepspeed", "layout_dp", "topology_of",
    "load_config", "parse_overrides", "read_file", "read_tree", "resolve", "to_dict", "to_yaml", "translate",
    "unsupported", "validate",
]
