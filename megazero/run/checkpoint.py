"""Checkpoints that reshard: model weights are stored by logical name at full size, so any
PP x TP x DP layout (and any ZeRO stage) can load them.

Layout on disk (`<dir>/step<N>/`):
- `model_pp<s>.pt`: {logical_name: full fp32 tensor} of pipeline stage s's layers (written by the
  rank with dp = 0, tp = 0 of that stage after gathering the TP shards; ZeRO-3 shards are gathered
  over dp first). A tied embedding/head appears in the first and last stage's files, equal.
- `optimizer_rank<r>.pt`: this rank's optimizer state (fp32 master and Adam moments of its shard,
  step, loss scaler, LR schedule): exact resume in the same layout.
- `meta.json`: step, layout, config.
`load_weights(dir, module, optimizer)` reads the weights of every file into any layout; `load`
also restores the optimizer state when the layout and ZeRO stage are the saved ones.
"""
from __future__ import annotations

import glob
import json
import os

import torch

from megazero.runtime import comm
from megazero.tensor_parallel import gather_full_params, load_full_params


def save(directory: str, step: int, module, optimizer, pctx, lr_scheduler=None, config=None) -> str:
    """Write step `step`'s checkpoint. Collective over every rank (TP gathers over tp_group, ZeRO-3
    gathers over dp_group, a barrier over world_group at the end)."""
    path = os.path.join(directory, f"step{step}")
    os.makedirs(path, exist_ok=True)
    with optimizer.full_parameters():
        full = gather_full_params(module, pctx.tp_group)
    if pctx.dp_rank == 0 and pctx.tp_rank == 0:
        torch.save({k: v.detach().float().cpu() for k, v in full.items()}, os.path.join(path, f"model_pp{pctx.pp_rank}.pt"))
    state = {"step": step, "optimizer": optimizer.state_dict(),
             "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None}
    torch.save(state, os.path.join(path, f"optimizer_rank{pctx.global_rank}.pt"))
    if pctx.global_rank == 0:
        t = pctx.topology
        meta = {"step": step, "layout": {"pp": t.pp, "dp": t.dp, "tp": t.tp}, "zero_stage": optimizer.stage,
                "config": config}
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2, default=str)
    comm.barrier(pctx.world_group)
    return path


def latest(directory: str) -> str | None:
    """The newest `step<N>` directory under `directory`, or None."""
    steps = sorted(glob.glob(os.path.join(directory, "step*")), key=lambda p: int(p.rsplit("step", 1)[1]))
    return steps[-1] if steps else None


@torch.no_grad()
def load_weights(path: str, module, optimizer=None) -> None:
    """Load full logical weights from every `model_pp*.pt` under `path` into this rank's shards
    (any layout, any ZeRO stage; no communication but the ZeRO-3 gather/scatter over dp). With a
    ZeRO optimizer its flat buffers and fp32 master are refreshed too."""
    files = sorted(glob.glob(os.path.join(path, "model_pp*.pt")))
    if not files:
        raise FileNotFoundError(f"no model_pp*.pt under {path!r}: not a megazero checkpoint directory "
                                f"(expected <checkpoint.dir>/step<N>/)")
    full = {}
    for f in files:
        full.update(torch.load(f, map_location="cpu", weights_only=True))
    if optimizer is None:
        load_full_params(module, full, strict=True)
        return
    with optimizer.full_parameters(writeback=True):
        load_full_params(module, full, strict=True)


def load(path: str, module, optimizer, pctx, lr_scheduler=None) -> tuple[int, bool]:
    """Resume from checkpoint directory `path`: weights always (any layout); optimizer state, loss
    scale and LR schedule exactly when the layout and ZeRO stage match the saved ones. Returns
    (step, whether the optimizer state was restored)."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    load_weights(path, module, optimizer)
    t = pctx.topology
    same = meta["layout"] == {"pp": t.pp, "dp": t.dp, "tp": t.tp} and meta["zero_stage"] == optimizer.stage
    if same:
        state = torch.load(os.path.join(path, f"optimizer_rank{pctx.global_rank}.pt"), map_location="cpu",
                           weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        if lr_scheduler is not None and state["lr_scheduler"] is not None:
            lr_scheduler.load_state_dict(state["lr_scheduler"])
    return meta["step"], same
