"""megazero: 3D-parallel (pipeline x tensor x ZeRO data parallel) training of large transformers.

The names a DeepSpeed script uses after ``import megazero as deepspeed``: `initialize`,
`init_distributed`, `add_config_arguments`, and the subpackages at DeepSpeed's paths (`zero`, `pipe`,
`ops`, `utils`, `accelerator`, `comm`, `checkpointing`, `moe`, `runtime.pipe`, `runtime.utils`; the
DeepSpeed-only code behind them is in `megazero.compat`), imported on first use, so that
``import megazero`` stays light.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_SUBPACKAGES = ("zero", "pipe", "ops", "utils", "engine", "run", "core", "runtime", "models", "data", "tensor_parallel",
                "pipeline", "activation_checkpoint", "accelerator", "comm", "checkpointing", "moe", "compat", "profiling",
                "monitor", "checkpoint", "resilience", "toolbox", "context_parallel", "planner", "viz")


def initialize(*args, **kwargs):
    """See `megazero.engine.initialize` (DeepSpeed's arguments); the engine is registered as live for
    DeepSpeed's free functions (`megazero.compat.deepspeed_init.initialize`)."""
    from megazero.compat.deepspeed_init import initialize as _initialize

    return _initialize(*args, **kwargs)


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout=None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1, world_size: int = -1):
    """See `megazero.compat.dist_api.init_distributed` (DeepSpeed's arguments)."""
    from megazero.compat.dist_api import init_distributed as _init

    return _init(dist_backend, auto_mpi_discovery, distributed_port, verbose, timeout or 1800, init_method,
                 dist_init_required, config, rank, world_size)


def add_config_arguments(parser):
    """DeepSpeed's `add_config_arguments`: adds --deepspeed, --deepspeed_config (a megazero or
    DeepSpeed config file, read by `initialize(args=args)`) and the deprecated --deepscale and
    --deepscale_config to an argparse parser, as DeepSpeed's does. Not --local_rank: scripts add it
    themselves (DeepSpeed's tutorials do), and a second definition makes argparse fail."""
    group = parser.add_argument_group("megazero", "megazero (DeepSpeed-compatible) configuration")
    group.add_argument("--deepspeed", default=False, action="store_true", help="accepted for DeepSpeed scripts")
    group.add_argument("--deepspeed_config", default=None, type=str, help="config file (megazero or DeepSpeed JSON)")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated: --deepspeed_config")
    return parser


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"megazero.{name}")
    raise AttributeError(f"module 'megazero' has no attribute {name!r}")
