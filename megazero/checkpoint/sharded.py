"""Sharded checkpoints that load into any layout, written so that a crash never leaves a bad one.

On disk, ``<dir>/<tag>/`` (tag ``step<N>`` unless given):

- ``rank<r>.safetensors``: what global rank r owns and nobody else writes: for each parameter, the
  boxes of the logical tensor its ZeRO shard of its shard holds (split over TP, and MoE experts over
  the expert-parallel group too; `megazero.core.shard_boxes`), in the tensor's own dims, as
  fp32 tensors ``<kind>/<logical name>/<i>`` for kind in master, exp_avg, exp_avg_sq; and the rank's
  RNG states (``rng/...``: torch CPU and CUDA, megazero's TP/dropout streams) and its optimizer's state
  of its own (``rank/...``: 1-bit Adam's error feedback, `ZeroOptimizer.rank_state`).
- ``manifest.json``: readable by a person: step, layout (pp, tp, dp, axis order, ZeRO stage, chunks),
  the optimizer's and LR schedule's scalars, engine counters, the user's client_state, the config,
  and for every logical tensor its shape and the (file, key, offsets, sizes) of each stored box.
- ``<dir>/latest``: the newest complete tag.

The format is ``megazero-sharded-1`` still: a box has one offset and one size per dim of its tensor.
The first MoE checkpoints wrote the experts' 3-D tensors (E, f, h) as 2-D boxes of (E, f·h) (their only
split dim was E); loading and `checkpoint_convert` read those too (`_stored_boxes`).

Saving writes to ``<tag>.tmp/``, fsyncs each file, agrees over the world group that every rank
succeeded, writes the manifest, renames the directory into place, then moves ``latest``: a process
killed during a save leaves the previous checkpoint and ``latest`` as they were. No rank gathers
anything but its own slices; ZeRO-3 shards are written as they are, streamed box by box. An
asynchronous save copies the boxes to host memory first and commits from a background thread over
pctx.background_group. A weights-only checkpoint (kinds ``("master",)``: an import, the scratch
of `save_16bit_model`) loads into a fresh optimizer.

Loading reads the manifest on every rank, checks the model's names and shapes against it, and fills
each rank's own slices (master weights, and Adam moments unless told not to) from the boxes that
overlap them, whatever layout wrote them (reading slices, never whole files); then the working
weights are published from the masters.
RNG states are restored when the layout is the saved one (another layout draws other streams). Every
rank agrees on a failure and raises the same `CheckpointError`, naming the file and the tensor.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading

import torch
from safetensors import safe_open

from megazero.checkpoint import safetensors_io
from megazero.checkpoint.read import CheckpointError, Readers, copy_overlaps
from megazero.core.shard_boxes import numel, slice_boxes
from megazero.moe.user_layer import global_expert_name
from megazero.runtime import comm

KINDS = ("master", "exp_avg", "exp_avg_sq")  # FlatGroup attributes: per-bucket owned fp32 slices
FORMAT = "megazero-sharded-1"


# -- the slices a rank owns ------------------------------------------------------------------------

def _named(module, pctx, optimizer) -> dict[int, tuple[str, tuple, tuple]]:
    """{id(param): (logical name, full shape, splits)}: megazero's parameter metadata, `splits` the
    (dim, this rank's index, ranks) of each split dim (`megazero.core.shard_boxes`): MoE routed experts
    over the expert-parallel group along ep_dim, any parameter over TP along tp_dim (experts too under
    expert tensor parallelism); () whole. A plain nn.Module's (tp = 1) `named_parameters` are whole,
    the experts of its DeepSpeed-style MoE layers named by their global index (`global_expert_name`:
    each ep rank holds other experts under the same local names), their shapes the optimizer's (ZeRO-3
    empties a parameter's data between uses)."""
    shapes = {id(p): tuple(group.shapes[i]) for group in optimizer.groups for i, p in enumerate(group.params)}
    out = {}
    for name, p in module.named_parameters():
        if id(p) in out:
            continue
        logical = getattr(p, "logical_name", None)
        if logical is None:
            out[id(p)] = (global_expert_name(name, p), shapes.get(id(p), tuple(p.shape)), ())
            continue
        splits = []
        if getattr(p, "ep_dim", None) is not None:
            splits.append((p.ep_dim, p.ep_rank, p.ep_size))
        if p.tp_dim is not None:
            splits.append((p.tp_dim, pctx.tp_rank, pctx.tp_size))
        out[id(p)] = (logical, tuple(p.full_shape), tuple(splits))
    return out


def _pieces(module, optimizer, pctx, writing: bool):
    """(logical name, full shape, source index (group, bucket), offset in the owned slice, Piece) of
    every box this rank holds. Writing skips copies another rank writes too (replicas over the group's
    dp at stage 0, TP replicas of parameters not split over TP)."""
    named = _named(module, pctx, optimizer)
    for g, group in enumerate(optimizer.groups):
        if writing and group.stage == 0 and group.dp.rank != 0:  # experts: their expert-data-parallel group
            continue
        for b, segs in enumerate(group.segments):
            lo = group.owned[b][0]
            for seg in segs:
                param = group.params[seg.param]
                name, full_shape, splits = named[id(param)]
                if writing and getattr(param, "tp_dim", None) is None and pctx.tp_rank != 0:
                    continue
                for piece in slice_boxes(full_shape, splits, tuple(group.shapes[seg.param]), seg.param_start,
                                         seg.param_start + seg.numel):
                    yield name, full_shape, (g, b), seg.buf_start - lo + piece.flat_start, piece


def _view(flat: torch.Tensor, offset: int, piece) -> torch.Tensor:
    """The elements of `piece` inside a bucket's owned slice `flat`, as a view of its logical box."""
    sizes = piece.shard_box[1]
    view = flat[offset:offset + numel(piece.shard_box)].view(sizes)  # the shard box, row-major
    return view[tuple(slice(0, n) for n in piece.box[1])]


def _trackers(module) -> list:
    from megazero.tensor_parallel import Dropout

    seen = {}
    for m in module.modules():
        if isinstance(m, Dropout):
            seen[id(m.tracker)] = m.tracker
    return list(seen.values())


# -- save --------------------------------------------------------------------------------------------

def save(directory: str, tag: str, step: int, module, optimizer, pctx, lr_scheduler=None, config=None,
         client_state=None, engine_state=None, save_latest: bool = True, keep_last: int = 0,
         kinds: tuple = KINDS, async_save: bool = False):
    """Write checkpoint `tag` under `directory` (see the module docstring) and return its path.

    `kinds`: which per-parameter tensors to store (``("master",)`` for weights only). Synchronous
    saves stream each box straight from the optimizer's buffers to the file (memory: one box) and are
    collective over pctx.world_group (an all-gather of the piece lists, an agreement, barriers).
    With `async_save` the boxes are first copied to host memory (the rank's shard of each kind), a
    background thread writes and commits them with the same collectives over
    pctx.background_group, and a `PendingSave` is returned at once: training may go on (the snapshot
    is the state at this call); `PendingSave.wait()` returns the path or raises the agreed error.
    """
    layout, tensors, entries, copied = _snapshot(module, optimizer, pctx, kinds, copy=async_save)
    meta = _meta(step, module, pctx, optimizer, lr_scheduler, config, client_state, engine_state, kinds)
    args = (directory, tag, layout, tensors, entries, meta, pctx.global_rank, save_latest, keep_last)
    if not async_save:
        return write_and_commit(*args, pctx.world_group)

    group = pctx.background_group  # here, in the training thread: every rank creates it at the same point

    def work():
        if copied is not None:  # the device-to-host copies, enqueued in stream order: the thread waits, not training
            copied.synchronize()
        return write_and_commit(*args, group)

    return PendingSave(os.path.join(directory, tag), work)


class PendingSave:
    """An asynchronous save in flight: a daemon thread writes the host snapshot, agrees with the other
    ranks over the background group and commits (rename, `latest`). A process that exits before
    `wait()` leaves ``<tag>.tmp`` and the previous `latest`, as a crash does."""

    def __init__(self, path: str, work):
        self.path, self._error = path, None
        self._thread = threading.Thread(target=self._run, args=(work,), name="megazero-checkpoint", daemon=True)
        self._thread.start()

    def _run(self, work) -> None:
        try:
            work()
        except BaseException as err:  # re-raised by wait() in the training thread
            self._error = err

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> str:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.path


def _snapshot(module, optimizer, pctx, kinds, copy: bool):
    """(file layout [(key, dtype, shape)], tensors in that order, manifest entries, a CUDA event or None)
    of this rank's boxes and RNG states; the tensors are views of the optimizer's buffers, or, with
    `copy`, views of host copies: each (group, kind)'s owned slices copied in one pass into one buffer
    (pinned where CUDA exists, copied without blocking the host; the event marks their end)."""
    layout, tensors, entries = [], [], []
    staged: dict[tuple[int, str], list[torch.Tensor]] = {}
    fname = f"rank{pctx.global_rank}.safetensors"
    for i, (name, shape, (g, b), offset, piece) in enumerate(_pieces(module, optimizer, pctx, writing=True)):
        for kind in kinds:
            key = f"{kind}/{name}/{i}"
            slices = getattr(optimizer.groups[g], kind)
            if copy:
                if (g, kind) not in staged:
                    staged[(g, kind)] = _stage(slices)
                slices = staged[(g, kind)]
            t = _view(slices[b], offset, piece)
            tensors.append(t)
            layout.append((key, t.dtype, tuple(t.shape)))
            entries.append((name, list(shape), kind, fname, key, list(piece.box[0]), list(piece.box[1])))
    for key, t in _rng_tensors(module).items():  # fresh copies already
        tensors.append(t)
        layout.append((key, t.dtype, tuple(t.shape)))
    for key, t in optimizer.rank_state().items():  # fresh copies already
        tensors.append(t.cpu())
        layout.append((f"rank/{key}", t.dtype, tuple(t.shape)))
    copied = None
    if copy and any(parts[0].is_pinned() for parts in staged.values() if parts):
        copied = torch.cuda.Event()
        copied.record()
    return layout, tensors, entries, copied


def _stage(slices: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of a group's per-bucket owned slices of one kind, in one buffer (pinned and copied
    without blocking the host when they are on a GPU: the caller records an event after)."""
    sizes = [t.numel() for t in slices]
    on_gpu = bool(slices) and slices[0].device.type == "cuda"
    flat = torch.empty(sum(sizes), dtype=slices[0].dtype if slices else torch.float32, pin_memory=on_gpu)
    parts = list(torch.split(flat, sizes))
    for host, src in zip(parts, slices):
        host.copy_(src.reshape(-1), non_blocking=on_gpu)
    return parts


def write_and_commit(directory, tag, layout, tensors, entries, meta, rank, save_latest, keep_last, group) -> str:
    """Write this rank's file into ``<tag>.tmp``, agree over `group` (every rank) that all succeeded,
    then rank 0 writes the manifest, renames the directory into place and moves `latest`."""
    final = os.path.join(directory, tag)
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    comm.barrier(group)
    error = None
    try:
        safetensors_io.write(os.path.join(tmp, f"rank{rank}.safetensors"), layout, tensors, {"format": "pt"})
    except Exception as err:  # agreed below: no rank renames a checkpoint another rank failed to write
        error = f"rank {rank}: {type(err).__name__}: {err}"
    gathered = comm.all_gather_object((error, entries), group)
    errors = [e for e, _ in gathered if e]
    if errors:
        raise CheckpointError(f"saving {final} failed ({len(errors)} rank(s)); first: {errors[0]}")
    if rank == 0:
        manifest = dict(meta, tensors=tensor_records([e for _, rank_entries in gathered for e in rank_entries]))
        mpath = os.path.join(tmp, "manifest.json")
        with open(mpath, "w") as f:
            json.dump(manifest, f, indent=1, default=str)
        _fsync(mpath)
        if os.path.exists(final):  # saving a tag again: the old copy goes only once the new one is complete
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(directory)
        if save_latest:
            _write_atomic(os.path.join(directory, "latest"), tag)
        if keep_last:
            _prune(directory, keep_last)
    comm.barrier(group)
    return final


def _meta(step, module, pctx, optimizer, lr_scheduler, config, client_state, engine_state, kinds) -> dict:
    """Everything of the manifest but the tensor records, as JSON-able copies taken now."""
    t = pctx.topology
    spec = getattr(module, "model_spec", None)
    meta = {"format": FORMAT, "step": step,
            "layout": {"pp": t.pp, "tp": t.tp, "dp": t.dp, "cp": t.size("cp"), "order": list(t.order),
                       "zero_stage": optimizer.stage},
            "kinds": list(kinds), "rng": True, "model": dataclasses.asdict(spec) if spec is not None else None,
            "optimizer": {"step_count": optimizer.step_count, "param_groups": optimizer.hyperparameters(),
                          "scaler": optimizer.scaler.state_dict(), "skipped_steps": optimizer.skipped_steps},
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "engine": engine_state or {}, "client_state": client_state, "config": config}
    return json.loads(json.dumps(meta, default=str))  # a deep copy: training may go on while it is written


def tensor_records(entries) -> dict:
    """{logical name: {"shape", kind: [{"file", "key", "offsets", "sizes"}]}} of every rank's entries."""
    tensors: dict = {}
    for name, shape, kind, fname, key, offsets, sizes in entries:
        record = tensors.setdefault(name, {"shape": shape, **{k: [] for k in KINDS}})
        boxes = record[kind]
        if any(bx["offsets"] == offsets and bx["sizes"] == sizes for bx in boxes):
            continue  # a tied weight written by two stages: one copy is enough
        boxes.append({"file": fname, "key": key, "offsets": offsets, "sizes": sizes})
    return tensors


def _rng_tensors(module) -> dict[str, torch.Tensor]:
    out = {"rng/cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["rng/cuda"] = torch.cuda.get_rng_state()
    for i, tracker in enumerate(_trackers(module)):
        for (stream, dev), state in tracker.get_states().items():
            out[f"rng/tracker{i}/{stream}/{dev}"] = state
    return out


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _prune(directory: str, keep_last: int) -> None:
    """Delete complete checkpoints (those with a manifest) beyond the newest `keep_last`, by step."""
    done = []
    for tag in os.listdir(directory):
        mpath = os.path.join(directory, tag, "manifest.json")
        if not tag.endswith(".tmp") and os.path.isfile(mpath):
            with open(mpath) as f:
                done.append((json.load(f)["step"], tag))
    for _, tag in sorted(done)[:-keep_last]:
        shutil.rmtree(os.path.join(directory, tag))


# -- load --------------------------------------------------------------------------------------------

def resolve(path: str, tag: str | None = None) -> str:
    """The checkpoint directory of `path`: `path/tag`, `path/<latest>`, or `path` itself."""
    if tag is not None:
        return os.path.join(path, tag)
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            return os.path.join(path, f.read().strip())
    return path


def has_checkpoint(directory: str | None) -> bool:
    return bool(directory) and os.path.isfile(os.path.join(directory, "latest"))


def load(path: str, module, optimizer, pctx, lr_scheduler=None, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True, load_module_only: bool = False) -> dict:
    """Load checkpoint directory `path` into this rank's slices (see the module docstring); returns
    the manifest. Collective over pctx.world_group (the agreement on errors; stage 1-2 all-gathers
    of the published weights)."""
    error, manifest = None, None
    try:
        manifest = read_manifest(path)
        _check_model(manifest, module, path, pctx, optimizer)
        saved = (manifest["optimizer"] or {}).get("param_groups")
        if saved is not None and not load_module_only and len(saved) != len(optimizer.param_groups):
            raise CheckpointError(f"{path}/manifest.json: saved with {len(saved)} optimizer parameter groups, this "
                                  f"optimizer has {len(optimizer.param_groups)}; build it with the same groups, or "
                                  f"load with load_module_only=True")
        wanted = KINDS if load_optimizer_states and not load_module_only else ("master",)
        _fill(path, manifest, module, optimizer, pctx, [k for k in wanted if k in manifest["kinds"]])
    except Exception as err:
        error = f"{type(err).__name__}: {err}" if not isinstance(err, CheckpointError) else str(err)
    gathered = comm.all_gather_object(error, pctx.world_group)
    errors = [(r, e) for r, e in enumerate(gathered) if e]
    if errors:
        r, first = errors[0]
        raise CheckpointError(f"loading {path} failed on {len(errors)} rank(s); rank {r}: {first}")
    for group in optimizer.groups:
        group.publish_master(optimizer.allgather_bucket_size)
    if not load_module_only:
        opt = manifest["optimizer"]  # None: weights only (an import, a 16-bit model): a fresh optimizer
        if opt is not None and load_optimizer_states and "exp_avg" in manifest["kinds"]:
            optimizer.step_count = opt["step_count"]
            optimizer.scaler.load_state_dict(opt["scaler"])
            optimizer.skipped_steps = opt["skipped_steps"]
        if opt is not None:
            optimizer.load_hyperparameters(opt["param_groups"])
        if lr_scheduler is not None and load_lr_scheduler_states and manifest["lr_scheduler"] is not None:
            lr_scheduler.load_state_dict(manifest["lr_scheduler"])
        if manifest["rng"] and _same_layout(manifest, pctx, optimizer):
            _restore_rng(path, module, pctx)
            if opt is not None and load_optimizer_states:
                _restore_rank_state(path, optimizer, pctx)
    return manifest


def _same_layout(manifest, pctx, optimizer) -> bool:
    t = pctx.topology
    saved = {"cp": 1, **manifest["layout"]}  # checkpoints from before context parallelism: cp 1
    return saved == {"pp": t.pp, "tp": t.tp, "dp": t.dp, "cp": t.size("cp"), "order": list(t.order),
                     "zero_stage": optimizer.stage}


def read_manifest(path: str) -> dict:
    mpath = os.path.join(path, "manifest.json")
    if not os.path.isfile(mpath):
        tmp = " (an unfinished save: <tag>.tmp)" if path.endswith(".tmp") else ""
        raise CheckpointError(f"{mpath}: no manifest; not a complete megazero checkpoint{tmp}")
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{mpath}: cannot be read ({err})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def _check_model(manifest: dict, module, path: str, pctx, optimizer) -> None:
    saved = manifest["tensors"]
    for name, shape, _ in _named(module, pctx, optimizer).values():
        record = saved.get(name)
        if record is None:
            raise CheckpointError(f"{path}/manifest.json has no tensor {name!r}: it was saved from another "
                                  f"model ({len(saved)} tensors, e.g. {sorted(saved)[:2]})")
        if tuple(record["shape"]) != tuple(shape):
            raise CheckpointError(f"{path}/manifest.json: {name} has shape {tuple(record['shape'])}, the model's "
                                  f"is {shape}: it was saved from another model")


def _fill(path: str, manifest: dict, module, optimizer, pctx, kinds) -> None:
    """Copy every box this rank needs out of the stored boxes that overlap it (lazy slice reads)."""
    with Readers(path) as readers:
        for name, _, (g, b), offset, piece in _pieces(module, optimizer, pctx, writing=False):
            for kind in kinds:
                dest = _view(getattr(optimizer.groups[g], kind)[b], offset, piece)
                record = manifest["tensors"][name]
                filled = copy_overlaps(readers, record[kind], piece.box, dest, record["shape"])
                if filled != numel(piece.box):
                    raise CheckpointError(f"{path}: {kind} of {name} box {piece.box} is only {filled} of "
                                          f"{numel(piece.box)} elements in the stored boxes")


def _restore_rank_state(path: str, optimizer, pctx) -> None:
    """The optimizer's per-rank state (`ZeroOptimizer.rank_state`), where this rank saved one; in
    another layout it starts afresh (1-bit Adam: zero error feedback)."""
    with safe_open(os.path.join(path, f"rank{pctx.global_rank}.safetensors"), framework="pt") as f:
        saved = {k[len("rank/"):]: f.get_tensor(k) for k in f.keys() if k.startswith("rank/")}
    optimizer.load_rank_state(saved)


def _restore_rng(path: str, module, pctx) -> None:
    with safe_open(os.path.join(path, f"rank{pctx.global_rank}.safetensors"), framework="pt") as f:
        set_rng_states(module, {k: f.get_tensor(k) for k in f.keys() if k.startswith("rng/")})


def rng_states(module) -> dict[str, torch.Tensor]:
    """This process' random states that a step of `module` draws from (torch's CPU and CUDA generators, the
    TP dropout trackers), as fresh copies keyed as in a checkpoint. Local."""
    return _rng_tensors(module)


def set_rng_states(module, states: dict[str, torch.Tensor]) -> None:
    """Put back `rng_states`' states (from this process or a checkpoint). Local."""
    torch.set_rng_state(states["rng/cpu"])
    if "rng/cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["rng/cuda"])
    for i, tracker in enumerate(_trackers(module)):
        prefix = f"rng/tracker{i}/"
        mine = {tuple(k[len(prefix):].split("/", 1)): v for k, v in states.items() if k.startswith(prefix)}
        tracker.set_states(mine)
