"""``python -m megazero.core.config explain CONFIG [key=value ...] --world-size N``

Prints the resolved config as YAML, then dp size, micro-batches per pipeline flush and the
bubble fraction of the chosen schedule. Exit status 2 with the error on stderr for a bad config.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .errors import ConfigError
from .explain import explain
from .loading import deepspeed_defaults_of, load_config


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megazero.core.config", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="print the resolved config and derived values")
    ex.add_argument("config", help="a .yaml/.yml/.json file (megazero or DeepSpeed JSON), or 'none'")
    ex.add_argument("overrides", nargs="*", help="key=value overrides, e.g. parallel.pp=2 model.layers=6")
    ex.add_argument("--world-size", type=int, default=None,
                    help="number of ranks (default: pp x tp x dp when parallel.dp is set)")
    ex.add_argument("--gpus-per-node", type=int, default=8,
                    help="GPUs per node, for the Mixture-of-Experts per-node rule (default 8)")
    args = parser.parse_args(argv)
    path = None if args.config == "none" else args.config
    try:
        cfg = load_config(path, args.overrides, world_size=args.world_size)
        sys.stdout.write(explain(cfg, args.world_size, deepspeed_defaults_of(path), args.gpus_per_node))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
