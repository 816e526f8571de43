"""The trainer CLI.

    torchrun --nproc_per_node=8 -m megazero.train configs/demo.yaml [key=value ...]
    python -m megazero.train configs/debug_gpt.yaml parallel.pp=1 parallel.tp=1   # one process

Every rank validates the config before any process group exists; a bad config, a layout that does
not fit the world size, or a missing data file ends every rank with one clear line (exit code 2).
Rank 0 prints a start summary, a progress bar, and the breakdowns; it writes one JSON object per
step to log.metrics_file. Checkpoints go to checkpoint.dir every checkpoint.save_interval steps
and at the end; per-rank Chrome traces to <run_dir>/trace/ when trace.enabled.
"""
from __future__ import annotations

import os
import sys

from megazero.config import ConfigError
from megazero.spec import SpecError


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    path, overrides = argv[0], argv[1:]
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    try:
        from megazero.engine import load_run_config

        if not os.path.exists(path):
            raise ConfigError(f"config file {path!r} does not exist")
        cfg = load_run_config(path, overrides)
        _check_data(cfg)
    except (ConfigError, SpecError, FileNotFoundError) as err:
        print(f"megazero.train: error: {str(err).splitlines()[0] if rank else err}", file=sys.stderr)
        return 2
    from megazero.trainer_loop import run

    return run(cfg, rank)


def _check_data(cfg) -> None:
    """Every rank checks the data path (only some stages read it; all must stop together)."""
    if cfg.data.path is None:
        return
    if not os.path.exists(cfg.data.path + ".idx") or not os.path.exists(cfg.data.path + ".bin"):
        raise FileNotFoundError(
            f"data.path={cfg.data.path!r}: {cfg.data.path}.bin/.idx not found; create them with "
            f"`python tools/preprocess_data.py --input FILES --output-prefix {cfg.data.path}`")


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # torch 2.13 + gloo can abort in interpreter teardown after a clean run
