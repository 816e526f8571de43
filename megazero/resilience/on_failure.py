"""``checkpoint.save_on_failure``'s trigger in the trainer: when a failed step's state is saved, and when the
saved parts become a checkpoint. The saving itself is `megazero.checkpoint.failure_save`.

- `SaveOnFailure.arm` (at the start, before any rank loads): SIGTERM raises `Terminated` from then on
  (torchrun stops the other ranks of an attempt one of whose ranks failed with it, so a step it interrupts
  fails like one whose peer died and this rank saves first); rank 0 makes a checkpoint of the parts the
  ranks left alive by the last failure saved (`failure_save.promote`); a barrier over the world group, so
  that every rank looks for ``latest`` after the promotion.
- `SaveOnFailure.train_step`: `engine.train_step`; when it raises, this rank writes its state on its own
  if it is a step's end (`failure_save.save_parts`, no communication), says so, and re-raises.
"""
from __future__ import annotations

import signal
import sys

from megazero.checkpoint import failure_save
from megazero.runtime import comm


class Terminated(RuntimeError):
    """SIGTERM arrived (with checkpoint.save_on_failure): torchrun stops the ranks of an attempt one of whose
    ranks failed; a step it interrupts fails like one whose peer died, so that this rank saves first."""


def _terminated(signum, frame):
    raise Terminated("SIGTERM: the launcher stops this rank (another rank failed)")


class SaveOnFailure:
    """The trigger for global rank `rank` of a run saving into checkpoint directory `directory`, with the
    run's config `config` (a dict) stored in what it saves."""

    def __init__(self, directory: str, config: dict, rank: int):
        self.directory, self.config, self.rank = directory, config, rank

    def arm(self, world_group) -> str | None:
        """Install the SIGTERM handler, promote the last failure's parts (rank 0; printed), then a barrier
        over `world_group`. Returns the promoted checkpoint's path on rank 0, else None."""
        signal.signal(signal.SIGTERM, _terminated)
        promoted = failure_save.promote(self.directory) if self.rank == 0 else None
        if promoted:
            print(f"the ranks left alive by the last failure saved {promoted}", flush=True)
        comm.barrier(world_group)
        return promoted

    def train_step(self, engine, data):
        """`engine.train_step(data)`; if it raises (a peer died), this rank's state is saved first when it is a
        step's end (no communication), then the error goes on."""
        try:
            return engine.train_step(data)
        except Exception:
            folder = failure_save.save_parts(self.directory, engine, self.config)
            print(f"[rank {self.rank}] step {engine.global_steps + 1} failed; " +
                  (f"state after step {engine.global_steps} saved to {folder}" if folder
                   else "state not saved: the failure came during the update"), file=sys.stderr, flush=True)
            raise
