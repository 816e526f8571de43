"""The one process-wide state of the DeepSpeed layer: the live engines that DeepSpeed's `initialize` built,
held by weak references, which DeepSpeed's free functions read (the comms logger's summary reads their
`CommStats`). Beside them, what DeepSpeed's free functions keep for the process when no engine is
involved: the `CommStats` of `megazero.comm`'s own calls (a user's collectives over the user's torch
groups), the comms logger's switches (`CommsOptions`), and `deepspeed.checkpointing`'s configuration,
RNG streams and checkpointer (`megazero.compat.activation_api.CheckpointingState`, held here so that it
is this registry's), and DeepSpeed's accelerator objects, one per device type
(`megazero.compat.accelerator.get_accelerator`). Nothing here communicates.
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from dataclasses import dataclass, field

from megazero.runtime.comm import CommStats


@dataclass
class CommsOptions:
    """DeepSpeed's comms logger switches (`deepspeed.comm.configure`, the config's ``comms_logger``)."""

    enabled: bool = False
    prof_all: bool = True
    prof_ops: list = field(default_factory=list)
    verbose: bool = False
    debug: bool = False

    @classmethod
    def switches(cls) -> tuple[str, ...]:
        """The switches' names (the comms logger's view reads and sets exactly these)."""
        return tuple(f.name for f in dataclasses.fields(cls))


class Registry:
    """The live engines (weak references: a dropped engine leaves), the stats of `megazero.comm`'s own
    calls, the comms logger's switches and the checkpointing state (see the module docstring)."""

    def __init__(self) -> None:
        self._engines: list[weakref.ref] = []
        self.comm_stats = CommStats()
        self.comms = CommsOptions()
        self.checkpointing = None  # deepspeed.checkpointing's state, made on first use (activation_api.state)
        self.accelerators: dict = {}  # device type -> DeepSpeed's accelerator object (accelerator._accelerator)

    def add(self, engine) -> None:
        """Register an engine DeepSpeed's `initialize` built."""
        self._engines = [r for r in self._engines if r() is not None] + [weakref.ref(engine)]

    def engines(self) -> list:
        """The registered engines still alive, oldest first."""
        return [e for e in (r() for r in self._engines) if e is not None]


@functools.cache
def registry() -> Registry:
    """The process's registry (one per process, as DeepSpeed's module globals)."""
    return Registry()


__all__ = ["CommsOptions", "Registry", "registry"]
