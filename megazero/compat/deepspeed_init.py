"""DeepSpeed's top-level `deepspeed.initialize` (`megazero.initialize`): megazero's engine, built by
`megazero.engine.initialize`, registered as live in the process's registry (`megazero.compat.engines`)
for DeepSpeed's free functions, and, when its config's ``comms_logger`` section is on, that section
applied to `megazero.comm`'s logger (DeepSpeed's engine does the same at construction)."""
from __future__ import annotations

from megazero.compat.dist_api import configure as configure_comms_logger
from megazero.compat.engines import registry


def initialize(*args, **kwargs):
    """DeepSpeed's `initialize` (same arguments; see `megazero.engine.initialize`): returns (engine,
    optimizer, dataloader, lr_scheduler). Communicates what building the engine communicates."""
    from megazero.engine import initialize as build

    engine, optimizer, loader, scheduler = build(*args, **kwargs)
    registry().add(engine)
    if engine.config.log.comms_logger.enabled:
        configure_comms_logger(engine.config)
    return engine, optimizer, loader, scheduler


__all__ = ["initialize"]
