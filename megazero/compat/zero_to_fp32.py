"""DeepSpeed's `zero_to_fp32`: a checkpoint's whole fp32 weights, in one process, without
torch.distributed. `get_fp32_state_dict_from_zero_checkpoint` returns them as a state dict;
`convert_zero_checkpoint_to_fp32_state_dict` writes them (`pytorch_model.bin`, or `model.safetensors`
with `safe_serialization`; sharded with an index file past `max_shard_size`, as DeepSpeed names
them); `load_state_dict_from_zero_checkpoint` loads them into a model. `main` is the command line of
the `zero_to_fp32.py` that every `save_checkpoint` leaves next to its checkpoints (DeepSpeed's):

    python zero_to_fp32.py <checkpoint_dir> <output_dir> [--safe_serialization] [-t TAG]

A megazero checkpoint of any layout (ZeRO stage, dp, tp, pp) holds every parameter's fp32 master
in boxes; each tensor is assembled from the boxes it is made of (`megazero.checkpoint.convert`).
Names are those the checkpoint records: a user module's `named_parameters` names, a megazero
model's logical names. Frozen parameters are not trained by the ZeRO optimizer and not saved.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from megazero.checkpoint import safetensors_io
from megazero.checkpoint.convert import full_tensor
from megazero.checkpoint.read import Readers
from megazero.checkpoint.sharded import read_manifest, resolve

SCRIPT = '''#!/usr/bin/env python
"""Written by megazero's save_checkpoint, as DeepSpeed writes its zero_to_fp32.py: the checkpoints in
this directory as one fp32 state dict, in one process, without GPUs.

    python zero_to_fp32.py . <output_dir> [--safe_serialization] [-t TAG]
"""
from megazero.compat.zero_to_fp32 import main

if __name__ == "__main__":
    main()
'''


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
                                             lazy_mode=False) -> dict:
    """{name: full fp32 tensor} of the checkpoint `checkpoint_dir/tag` (default: its `latest`).
    `lazy_mode` is accepted; the tensors are read eagerly (each from only the bytes it is made of)."""
    path = resolve(checkpoint_dir, tag)
    manifest = read_manifest(path)
    with Readers(path) as readers:
        return {name: full_tensor(readers, manifest, name) for name in manifest["tensors"]}


def _parse_size(size) -> int:
    if isinstance(size, int):
        return size
    text = str(size).strip().upper()
    for unit, mult in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * mult)
    return int(text)


def _shards(state: dict, limit: int) -> list[list[str]]:
    """Names in order, cut into runs of at most `limit` bytes (a bigger tensor is a shard alone)."""
    shards, current, size = [], [], 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if current and size + n > limit:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current or not shards:
        shards.append(current)
    return shards


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None,
                                               exclude_frozen_parameters=False) -> list[str]:
    """Write the checkpoint's fp32 weights into `output_dir` as DeepSpeed does: one
    `pytorch_model.bin` (torch.save) or `model.safetensors`, or shards `...-0000i-of-0000n...` with
    a `.index.json` (weight_map) past `max_shard_size`. Returns the files written."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    os.makedirs(output_dir, exist_ok=True)
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    shards = _shards(state, _parse_size(max_shard_size))
    files = []
    weight_map = {}
    for k, names in enumerate(shards, start=1):
        fname = f"{stem}.{ext}" if len(shards) == 1 else f"{stem}-{k:05d}-of-{len(shards):05d}.{ext}"
        part = {n: state[n].contiguous() for n in names}
        out = os.path.join(output_dir, fname)
        if safe_serialization:
            safetensors_io.write(out, [(n, t.dtype, tuple(t.shape)) for n, t in part.items()], part.values(),
                                 {"format": "pt"})
        else:
            torch.save(part, out)
        files.append(out)
        weight_map.update({n: fname for n in names})
    if len(shards) > 1:
        index = os.path.join(output_dir, f"{stem}.{ext}.index.json")
        total = sum(t.numel() * t.element_size() for t in state.values())
        with open(index, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        files.append(index)
    return files


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Load the checkpoint's fp32 weights into `model` (moved to the CPU first, as DeepSpeed does;
    strict: every checkpoint tensor must be one of the model's) and return the model."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise KeyError(f"load_state_dict_from_zero_checkpoint: the checkpoint has {unexpected[:3]}, which the model "
                       f"does not")
    return model


def write_script(save_dir: str) -> str:
    """Leave `zero_to_fp32.py` in `save_dir` (DeepSpeed's recovery script); returns its path."""
    path = os.path.join(save_dir, "zero_to_fp32.py")
    with open(path, "w") as f:
        f.write(SCRIPT)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="a megazero checkpoint's fp32 weights as one state dict")
    parser.add_argument("checkpoint_dir", help="the directory holding the checkpoints (and 'latest'), or one of them")
    parser.add_argument("output_dir", help="where pytorch_model.bin / model.safetensors (or shards) go")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors")
    parser.add_argument("-t", "--tag", default=None, help="the checkpoint (default: the one 'latest' names)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true")
    args = parser.parse_args(argv)
    for f in convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, args.max_shard_size,
                                                        args.safe_serialization, args.tag,
                                                        args.exclude_frozen_parameters):
        print(f)
