#!/usr/bin/env python
"""Convert megazero checkpoints: to one consolidated safetensors file, to Hugging Face, from Hugging Face.

    python tools/convert_checkpoint.py to-safetensors CKPT OUT.safetensors [--dtype fp32|bf16|fp16] [--kind master]
    python tools/convert_checkpoint.py to-hf CKPT OUT_DIR [--dtype fp32|bf16|fp16]
    python tools/convert_checkpoint.py from-hf HF_DIR OUT_DIR [--tag hf]

CKPT is a checkpoint directory (``<checkpoint.dir>/step<N>``) or a checkpoint.dir with a ``latest``,
written by any layout. One process, no torch.distributed; tensors are converted one at a time, so
memory stays at a few tensors whatever the model's size.

- to-safetensors: {logical name: full tensor} (the fp32 masters, or --kind exp_avg / exp_avg_sq).
- to-hf: config.json + model.safetensors that ``transformers.AutoModelForCausalLM.from_pretrained``
  loads (GPT-2 and Llama families, from the model spec the manifest records).
- from-hf: a Hugging Face model directory (safetensors, sharded safetensors or pytorch_model.bin;
  needs `transformers` for its config) becomes OUT_DIR/<tag> with OUT_DIR/latest, weights only, and
  OUT_DIR/model_spec.py. Train from it in any layout with
  ``model.spec=OUT_DIR/model_spec.py:hf checkpoint.load=OUT_DIR`` (the optimizer starts fresh).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout without an install


def main(argv=None) -> int:
    from megazero.checkpoint import convert as cc

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    one = sub.add_parser("to-safetensors", help="one consolidated safetensors file")
    one.add_argument("checkpoint")
    one.add_argument("out")
    one.add_argument("--dtype", choices=sorted(cc.DTYPES), default="fp32")
    one.add_argument("--kind", choices=["master", "exp_avg", "exp_avg_sq"], default="master")
    hf = sub.add_parser("to-hf", help="a Hugging Face transformers model directory")
    hf.add_argument("checkpoint")
    hf.add_argument("out")
    hf.add_argument("--dtype", choices=sorted(cc.DTYPES), default="fp32")
    back = sub.add_parser("from-hf", help="a megazero checkpoint from a Hugging Face model directory")
    back.add_argument("hf_dir")
    back.add_argument("out")
    back.add_argument("--tag", default="hf")
    args = ap.parse_args(argv)

    from megazero.core.spec import SpecError
    from megazero.checkpoint.sharded import CheckpointError, resolve

    try:
        if args.command == "to-safetensors":
            nbytes = cc.consolidate(resolve(args.checkpoint), args.out, cc.DTYPES[args.dtype], args.kind)
            print(f"wrote {args.out}: {nbytes / 2**20:.1f} MiB of {args.dtype} {args.kind} tensors")
        elif args.command == "to-hf":
            config = cc.export_hf(resolve(args.checkpoint), args.out, cc.DTYPES[args.dtype])
            print(f"wrote {args.out}: {config['architectures'][0]} ({args.dtype})")
        else:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory; never a download
            try:
                from transformers import AutoConfig
            except ImportError:
                print("error: from-hf reads the model's config with transformers: pip install transformers",
                      file=sys.stderr)
                return 2
            path = cc.import_hf(args.hf_dir, AutoConfig.from_pretrained(args.hf_dir), args.out, args.tag)
            print(f"wrote {path} and {os.path.join(args.out, 'model_spec.py')} (flavor 'hf'); train with "
                  f"model.spec={os.path.join(args.out, 'model_spec.py')}:hf checkpoint.load={args.out}")
    except (CheckpointError, SpecError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
