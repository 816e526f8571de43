"""Writing a safetensors file one tensor at a time, so that memory stays bounded by the largest tensor.

`safetensors.torch.save_file` serialises every tensor to bytes before it writes anything: saving a
rank's shard that way holds a second copy of the shard. The format is simple enough to stream
(https://github.com/huggingface/safetensors#format): an 8-byte little-endian header length, a JSON
header of ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` (plus ``__metadata__``),
padded with spaces to 8 bytes, then the tensors' bytes back to back in header order. Files written
here are read with `safetensors.safe_open`, which validates exactly that layout.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable

import torch

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.uint8: "U8", torch.int8: "I8", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL"}


def header(layout: list[tuple[str, torch.dtype, tuple]], metadata: dict | None = None) -> bytes:
    """The length-prefixed, padded header of tensors `layout` = [(name, dtype, shape)] in file order."""
    head, offset = {}, 0
    for name, dtype, shape in layout:
        if dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {dtype} cannot be stored; valid: {', '.join(map(str, DTYPES))}")
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        head[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        head["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write(path: str, layout: list[tuple[str, torch.dtype, tuple]], tensors: Iterable[torch.Tensor],
          metadata: dict | None = None) -> int:
    """Write `tensors` (an iterable, consumed one at a time, in `layout` order; CPU or device) to
    `path` and fsync it. Each tensor must have its layout entry's dtype and shape. Returns the bytes
    written."""
    total = 0
    with open(path, "wb") as f:
        f.write(header(layout, metadata))
        it = iter(tensors)
        for name, dtype, shape in layout:
            t = next(it, None)
            if t is None or t.dtype != dtype or tuple(t.shape) != tuple(shape):
                got = "nothing" if t is None else f"{t.dtype} {tuple(t.shape)}"
                raise ValueError(f"{path}: tensor {name} should be {dtype} {tuple(shape)}, got {got}")
            flat = t.detach().to("cpu").contiguous().reshape(-1)  # (numel,): a copy only if not contiguous
            if flat.numel():
                f.write(flat.view(torch.uint8).numpy().data)
                total += flat.numel() * flat.element_size()
        f.flush()
        os.fsync(f.fileno())
    return total
