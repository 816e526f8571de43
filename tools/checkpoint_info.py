#!/usr/bin/env python
"""Print what a megazero checkpoint holds: tag, step, the layout that wrote it, tensors and bytes.

    python tools/checkpoint_info.py DIR [--tensors]

DIR is a checkpoint directory (``<checkpoint.dir>/step<N>``) or a checkpoint.dir with a ``latest``.
Reads only the manifest and the files' sizes (no tensor is loaded). --tensors lists every logical
tensor with its shape and how many stored boxes hold it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout without an install


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--tensors", action="store_true")
    args = ap.parse_args(argv)
    from megazero.core.shard_boxes import numel
    from megazero.checkpoint.sharded import resolve

    path = resolve(args.dir)
    mpath = os.path.join(path, "manifest.json")
    if not os.path.isfile(mpath):
        print(f"checkpoint_info: {mpath} does not exist: not a complete megazero checkpoint", file=sys.stderr)
        return 2
    with open(mpath) as f:
        m = json.load(f)
    lay = m["layout"]
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    sizes = {n: os.path.getsize(os.path.join(path, n)) for n in files}
    tensors = m["tensors"]
    elements = sum(numel(((), tuple(rec["shape"]))) for rec in tensors.values())
    print(f"checkpoint {path}")
    print(f"  format   {m['format']}, step {m['step']}")
    cp = f" x cp={lay['cp']}" if lay.get("cp", 1) > 1 else ""
    print(f"  written  pp={lay['pp']} x tp={lay['tp']} x dp={lay['dp']}{cp}, order {','.join(lay['order'])}, "
          f"ZeRO-{lay['zero_stage']}")
    opt = m["optimizer"]
    if opt is None:
        print("  optimizer none (weights only: a fresh optimizer starts from it)")
    else:
        print(f"  optimizer step {opt['step_count']}, lr {opt['param_groups'][0]['lr']:.3g}, loss scale {opt['scaler'].get('scale')}, "
              f"skipped steps {opt['skipped_steps']}; LR schedule {m['lr_scheduler']}")
    if m.get("model"):
        spec = m["model"]
        print(f"  model    {spec['name'] or spec['family']}: {spec['layers']} layers, hidden {spec['hidden']}, "
              f"{spec['heads']} heads, vocab {spec['vocab']}")
    print(f"  tensors  {len(tensors)} logical ({elements / 1e6:.3f}M elements; {', '.join(m['kinds'])} each)")
    print(f"  files    {len(files)} rank files, {sum(sizes.values()) / 2**20:.2f} MiB "
          f"(largest {max(sizes.values(), default=0) / 2**20:.2f} MiB)")
    if m.get("client_state") is not None:
        print(f"  client_state {json.dumps(m['client_state'])[:200]}")
    if args.tensors:
        for name, rec in tensors.items():
            print(f"    {name:<40} {str(tuple(rec['shape'])):<14} {len(rec['master'])} boxes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
