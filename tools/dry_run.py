"""One training step of a layout at its real size, in one CPU process: what NCCL would hang on, and the peaks.

    python tools/dry_run.py configs/gpt3_175b.yaml --world-size 1024
    python tools/dry_run.py configs/debug_llama.yaml --world-size 8 parallel.dp=2 zero.stage=3

See megazero/toolbox/dry_run.py for what it runs and checks.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megazero.toolbox.dry_run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
