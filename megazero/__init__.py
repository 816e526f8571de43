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
                "pipeline", "activation_checkpoint", "accelerator", "comm", "checkpointing", "moe", "compat")


def initialize(*args, **kwargs):
    """See `megazero.engine.initialize` (DeepSpeed's arguments)."""
    from megazero.engine import initialize as _initialize

    return _initialize(*args, **kwargs)


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout=None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1, world_size: int = -1):
    """DeepSpeed's `init_distributed`: the default process group from torchrun's (or Slurm's)
    environment, on `dist_backend` (None: nccl on GPUs, gloo otherwise). `timeout` is a timedelta or
    seconds. MPI discovery, ports, init methods and explicit ranks are the launcher's business here:
    anything but their defaults is refused, naming the argument."""
    from datetime import timedelta

    from megazero.run.launch import init_distributed as _init

    for name, value, default in (("init_method", init_method, None), ("rank", rank, -1),
                                 ("world_size", world_size, -1)):
        if value != default:
            raise ValueError(f"init_distributed({name}={value!r}): megazero reads rank and world size from the "
                             f"launcher's environment (torchrun or Slurm); leave {name} unset")
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else (timeout or 1800)
    return _init(float(seconds), dist_backend or "auto")


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
