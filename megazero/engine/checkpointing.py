"""DeepSpeed's `save_checkpoint` / `load_checkpoint` / `save_16bit_model`, shared by both engines
(`megazero.checkpoint.sharded` and `megazero.checkpoint.convert` do the work). An engine has
`module`, `optimizer`, `pctx`, `lr_scheduler`, `global_steps` and `pending_save` (None, or the
asynchronous save in flight)."""
from __future__ import annotations

import os
import shutil

from megazero.runtime import comm


class CheckpointMethods:
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state=None, save_latest: bool = True,
                        keep_last: int = 0, config=None, async_save: bool = False) -> str:
        """Every rank writes the slices it owns to `save_dir/tag` (default ``step<global_steps>``) with
        the optimizer, LR schedule, RNG and `client_state` (any JSON-able value); `latest` moves once
        every rank succeeded; rank 0 leaves DeepSpeed's `zero_to_fp32.py` in `save_dir`
        (`megazero.compat.zero_to_fp32`). Collective over the world group. Returns the checkpoint's path.

        With `async_save` the state is copied to host memory and written by a background thread
        (collectives over the background group) while training goes on; the next save, a load, or
        `wait_for_checkpoint()` waits for it (and raises its error, agreed by every rank).
        """
        from megazero.compat.zero_to_fp32 import write_script
        from megazero.checkpoint import sharded

        self.wait_for_checkpoint()
        if self.pctx.global_rank == 0:  # DeepSpeed's recovery script next to the checkpoints
            os.makedirs(save_dir, exist_ok=True)
            write_script(save_dir)
        saved = sharded.save(save_dir, tag or f"step{self.global_steps}", self.global_steps, self.module,
                             self.optimizer, self.pctx, self.lr_scheduler, config=config, client_state=client_state,
                             engine_state={"global_steps": self.global_steps}, save_latest=save_latest,
                             keep_last=keep_last, async_save=async_save)
        if async_save:
            self.pending_save = saved
            return saved.path
        return saved

    def wait_for_checkpoint(self) -> str | None:
        """Wait for the asynchronous save in flight, if any; returns its path (None if there was none)."""
        pending, self.pending_save = self.pending_save, None
        return pending.wait() if pending is not None else None

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False):
        """Load `load_dir/tag` (default: `load_dir`'s ``latest``, or `load_dir` itself), written by any
        layout, into this one; returns (path, client_state). `load_module_strict` is accepted for
        DeepSpeed scripts: every parameter must be in the checkpoint. Collective over the world group."""
        from megazero.checkpoint import sharded

        self.wait_for_checkpoint()
        path = sharded.resolve(load_dir, tag)
        manifest = sharded.load(path, self.module, self.optimizer, self.pctx, self.lr_scheduler,
                                load_optimizer_states, load_lr_scheduler_states, load_module_only)
        if not load_module_only:
            self.global_steps = manifest["engine"].get("global_steps", manifest["step"])
        return path, manifest["client_state"]

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors") -> str:
        """One consolidated safetensors file `save_dir/save_filename` of the model's weights in its
        compute dtype (bf16/fp16, or fp32), by logical name, as DeepSpeed's (whose default file is
        pytorch_model.bin). No rank gathers the model: every rank writes its slices of the masters to
        a scratch checkpoint, then rank 0 streams them into the file tensor by tensor and removes it.
        Collective over the world group; returns the file's path."""
        from megazero.checkpoint import convert, sharded

        self.wait_for_checkpoint()
        dtype = next(self.module.parameters()).dtype
        scratch = sharded.save(save_dir, ".16bit-shards", self.global_steps, self.module, self.optimizer,
                               self.pctx, kinds=("master",), save_latest=False)
        out = os.path.join(save_dir, save_filename)
        if self.pctx.global_rank == 0:
            convert.consolidate(scratch, out, dtype)
            shutil.rmtree(scratch)
        comm.barrier(self.pctx.world_group)
        return out
