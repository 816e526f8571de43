"""Reading a sharded checkpoint's stored boxes (`megazero.checkpoint.sharded`'s format): the rank files
opened lazily with a bounded read window (`Readers`), and the overlap of any box of a logical tensor
with the boxes stored for it (`copy_overlaps`), including the 2-D boxes the first MoE checkpoints
wrote for 3-D tensors. Shared by loading and by the converters (`megazero.checkpoint.convert`).
"""
from __future__ import annotations

import os

import torch
from safetensors import safe_open

from megazero.core.shard_boxes import flat_range_boxes, intersect, numel


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or loaded; the message names the file and the tensor."""


class Readers:
    """The rank files of checkpoint `path`, opened lazily (safetensors mmap) with errors naming the file;
    a context manager that closes them. A file is closed (unmapped) again after every `window` bytes
    read from it, so that the pages read stay bounded by the window, not by the shard."""

    def __init__(self, path: str, window: int = 16 << 20):
        self.path, self.window, self._files, self._read = path, window, {}, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._files.clear()

    def slice(self, fname: str, key: str, index: tuple) -> torch.Tensor:
        """`index` (a tuple of slices) of stored tensor `key` in `fname`: only those bytes are read."""
        fpath = os.path.join(self.path, fname)
        if fname not in self._files:
            try:
                self._files[fname] = safe_open(fpath, framework="pt")
            except Exception as err:
                raise CheckpointError(f"{fpath}: {type(err).__name__}: {err}") from None
        try:
            part = self._files[fname].get_slice(key)[index]
        except Exception as err:
            raise CheckpointError(f"{fpath}: tensor {key}: {type(err).__name__}: {err}") from None
        self._read[fname] = self._read.get(fname, 0) + part.numel() * part.element_size()
        if self._read[fname] >= self.window:
            del self._files[fname]
            self._read[fname] = 0
        return part


def copy_overlaps(readers: Readers, stored: list[dict], box, dest: torch.Tensor, shape=None) -> int:
    """Copy into `dest` (holding logical box `box` = (offsets, sizes) of a tensor of logical `shape`)
    every part of the `stored` boxes (manifest records) that overlaps it; returns the number of
    elements copied. `shape` is needed only for records of the first MoE checkpoints (`_stored_boxes`)."""
    filled = 0
    for have, read in _stored_boxes(readers, stored, shape):
        common = intersect(box, have)
        if common is None or numel(common) == 0:
            continue
        src = tuple(slice(c - o, c - o + n) for c, o, n in zip(common[0], have[0], common[1]))
        dst = tuple(slice(c - o, c - o + n) for c, o, n in zip(common[0], box[0], common[1]))
        dest[dst].copy_(read(src))
        filled += numel(common)
    return filled


def _stored_boxes(readers: Readers, stored: list[dict], shape):
    """(box, read(index) -> tensor) of each stored record, in the logical tensor's own dims.

    Checkpoints written before boxes were N-dimensional stored a tensor of 3 or more dims (MoE experts
    (E, f, h), split over dim 0 only) as 2-D boxes of (E, f·h): such a record, ((e, c), (n, m)), is
    rows e .. e+n of the flat columns [c, c+m) of (f, h), which `flat_range_boxes` cuts into boxes of
    (f, h); each is read as its column range of the stored rows, reshaped."""
    for record in stored:
        offsets, sizes = tuple(record["offsets"]), tuple(record["sizes"])
        fname, key = record["file"], record["key"]
        if shape is None or len(offsets) == len(shape):
            yield (offsets, sizes), lambda index, fname=fname, key=key: readers.slice(fname, key, index)
            continue
        rest = tuple(shape[1:])
        for pos, (o, s) in flat_range_boxes(rest, offsets[1], offsets[1] + sizes[1]):
            def read(index, fname=fname, key=key, pos=pos, s=s):
                rows = readers.slice(fname, key, (index[0], slice(pos, pos + numel(((), s)))))
                return rows.reshape((rows.shape[0],) + s)[(slice(None),) + index[1:]]  # (rows, *box of (f, h))
            yield ((offsets[0],) + o, (sizes[0],) + s), read


__all__ = ["CheckpointError", "Readers", "copy_overlaps"]
