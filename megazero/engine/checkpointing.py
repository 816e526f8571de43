"""DeepSpeed's `save_checkpoint` / `load_checkpoint`, shared by both engines (`megazero.run.checkpoint`
does the work). An engine has `module`, `optimizer`, `pctx`, `lr_scheduler` and `global_steps`."""
from __future__ import annotations


class CheckpointMethods:
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state=None, save_latest: bool = True,
                        keep_last: int = 0, config=None) -> str:
        """Every rank writes the slices it owns to `save_dir/tag` (default ``step<global_steps>``) with
        the optimizer, LR schedule, RNG and `client_state` (any JSON-able value); `latest` moves once
        every rank succeeded. Collective over the world group. Returns the checkpoint's path."""
        from megazero.run import checkpoint

        return checkpoint.save(save_dir, tag or f"step{self.global_steps}", self.global_steps, self.module,
                               self.optimizer, self.pctx, self.lr_scheduler, config=config, client_state=client_state,
                               engine_state={"global_steps": self.global_steps}, save_latest=save_latest,
                               keep_last=keep_last)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False):
        """Load `load_dir/tag` (default: `load_dir`'s ``latest``, or `load_dir` itself), written by any
        layout, into this one; returns (path, client_state). `load_module_strict` is accepted for
        DeepSpeed scripts: every parameter must be in the checkpoint. Collective over the world group."""
        from megazero.run import checkpoint

        path = checkpoint.resolve(load_dir, tag)
        manifest = checkpoint.load(path, self.module, self.optimizer, self.pctx, self.lr_scheduler,
                                   load_optimizer_states, load_lr_scheduler_states, load_module_only)
        if not load_module_only:
            self.global_steps = manifest["engine"].get("global_steps", manifest["step"])
        return path, manifest["client_state"]
