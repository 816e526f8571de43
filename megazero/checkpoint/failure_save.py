"""``checkpoint.save_on_failure``: the state the ranks still alive hold when a peer dies, saved with no collective.

A normal save agrees over the world group, which a dead peer has broken. So when a step fails, every rank
still alive whose state is a step's end (`ZeroOptimizer.at_step_end`: the failure came before any update
of the step) writes what it owns on its own (`save_parts`), into ``<dir>/failed<N>.parts/``:
``rank<r>.safetensors`` as in a checkpoint, and ``rank<r>.json`` with its manifest entries and metadata
(N: the steps done). The dead ranks write nothing.

The next start (`promote`, rank 0, before any rank loads) makes a checkpoint of such a folder when it is
newer than ``latest`` and complete: every rank wrote the same step and layout, and the stored boxes cover
every logical tensor of every kind (so it is possible where each dead rank's state is held by another rank
too: replicas over dp at ZeRO stage 0; not for a dead rank's ZeRO shard of the optimizer states). It
writes the manifest, renames the folder to ``step<N>`` (or, when a save of that step completed meanwhile,
takes that) and moves ``latest``: the run resumes from the step that failed instead of the last save. Parts
older than ``latest`` are deleted. The random states of the dead ranks are lost: with dropout, the
resumed steps differ from an uninterrupted run's (without dropout they are the same). An incomplete folder
is left as it is and reported.
"""
from __future__ import annotations

import json
import os
import shutil

from megazero.checkpoint import safetensors_io
from megazero.checkpoint.sharded import (FORMAT, KINDS, _fsync, _meta, _snapshot, _write_atomic, read_manifest,
                                         resolve, tensor_records)
from megazero.core.shard_boxes import numel


def save_parts(directory: str, engine, config=None) -> str | None:
    """Write this rank's state to ``<directory>/failed<N>.parts/`` (see the module docstring) when it is a step's
    end; the folder, or None when it is not. No communication."""
    opt, pctx = engine.optimizer, engine.pctx
    if not opt.at_step_end(engine.applied_steps):
        return None
    step = engine.global_steps
    layout, tensors, entries, _ = _snapshot(engine.module, opt, pctx, KINDS, copy=False)
    at_start = engine.step_rng or {}  # the random states when the failed step began, not where it stopped
    tensors = [at_start.get(key, t) for (key, _, _), t in zip(layout, tensors)]
    meta = _meta(step, engine.module, pctx, opt, engine.lr_scheduler, config, None,
                 {"global_steps": step}, KINDS)
    meta["rng"] = bool(at_start)
    folder = os.path.join(directory, f"failed{step}.parts")
    os.makedirs(folder, exist_ok=True)
    r = pctx.global_rank
    record, data = os.path.join(folder, f"rank{r}.json"), os.path.join(folder, f"rank{r}.safetensors")
    if os.path.exists(record):  # an earlier attempt's part: gone before the data it describes is rewritten
        os.remove(record)
    safetensors_io.write(data + ".tmp", layout, tensors, {"format": "pt"})
    _fsync(data + ".tmp")
    os.replace(data + ".tmp", data)  # the record last: a part is complete or absent
    _write_atomic(record, json.dumps({"meta": meta, "entries": entries}))
    return folder


def promote(directory: str | None) -> str | None:
    """Make a checkpoint of the newest complete ``failed<N>.parts`` folder newer than ``latest`` (see the module
    docstring); its path, or None. Run by one process (rank 0) while the others wait. No communication."""
    if not directory or not os.path.isdir(directory):
        return None
    latest = _latest_step(directory)
    found = sorted((int(name[len("failed"):-len(".parts")]), name) for name in os.listdir(directory)
                   if name.startswith("failed") and name.endswith(".parts") and name[6:-6].isdigit())
    promoted = None
    for step, name in reversed(found):
        folder = os.path.join(directory, name)
        if step <= latest or promoted:  # older than what the run resumes from: of no use any more
            shutil.rmtree(folder, ignore_errors=True)
            continue
        final = os.path.join(directory, f"step{step}")
        if os.path.isfile(os.path.join(final, "manifest.json")):  # a complete save of that step already (an
            shutil.rmtree(folder, ignore_errors=True)             # asynchronous one that had not moved latest)
        else:
            problem, manifest = _assemble(folder, step)
            if problem:
                print(f"checkpoint.save_on_failure: {folder} is not a checkpoint: {problem}", flush=True)
                continue
            with open(os.path.join(folder, "manifest.json"), "w") as f:
                json.dump(manifest, f, indent=1)
            _fsync(os.path.join(folder, "manifest.json"))
            shutil.rmtree(final, ignore_errors=True)  # a directory without a manifest is no checkpoint
            os.rename(folder, final)
            _fsync(directory)
        _write_atomic(os.path.join(directory, "latest"), f"step{step}")
        promoted = final
    return promoted


def _latest_step(directory: str) -> int:
    if not os.path.isfile(os.path.join(directory, "latest")):
        return -1
    try:
        return read_manifest(resolve(directory))["step"]
    except Exception:  # noqa: BLE001  (a damaged latest: the normal load reports it)
        return -1


def _assemble(folder: str, step: int) -> tuple[str | None, dict | None]:
    """(what is wrong, None) or (None, the manifest) of a parts folder."""
    parts = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                parts.append(json.load(f))
    if not parts:
        return "no rank wrote its state", None
    metas = [p["meta"] for p in parts]
    if any(m["step"] != step or m["layout"] != metas[0]["layout"] or m["format"] != FORMAT for m in metas):
        return "the ranks wrote different steps or layouts", None
    tensors = tensor_records([tuple(e) for p in parts for e in p["entries"]])
    for name, record in tensors.items():
        for kind in KINDS:
            covered = sum(numel((box["offsets"], box["sizes"])) for box in record[kind])
            if covered < numel(([0] * len(record["shape"]), record["shape"])):
                return f"{kind} of {name}: {covered} of its elements were held by the ranks still alive", None
    layout = metas[0]["layout"]
    world = layout["pp"] * layout["tp"] * layout["dp"] * layout.get("cp", 1)
    rng = len(parts) == world and all(m["rng"] for m in metas)  # a dead rank's random states are lost
    manifest = dict(metas[0], tensors=tensors, rng=rng)
    return None, manifest
