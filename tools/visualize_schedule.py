#!/usr/bin/env python
"""Draw pipeline schedules: planned, predicted for a training config, measured in a run, or planned
above measured. The same command as ``python -m megazero.viz``; see `megazero/viz/cli.py` or
``--help`` for every option.

    python tools/visualize_schedule.py --schedule zb-h1 -p 4 -m 8 --out s.svg
    python tools/visualize_schedule.py --config configs/demo.yaml --world-size 8 --out predicted.html
    python tools/visualize_schedule.py --run runs/demo --compare --out compare.html
"""
import os
import sys

from megazero.viz.cli import UsageError, parse_costs, trace_grid  # noqa: F401  (kept for scripts)
from megazero.viz.cli import main as _main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    return _main(argv, hardware_dir=os.path.join(ROOT, "configs", "hardware"))


if __name__ == "__main__":
    sys.exit(main())
