"""Memory and step time of a layout before launch, or the best layouts for a cluster.

    python tools/plan.py gpt:gpt3-175b --hardware a100-80gb --gpus 1024 --global-batch 1536 \
        --tp 8 --pp 8 --micro-batch 1 --recompute full --schedule interleaved:2
    python tools/plan.py llama:llama3-405b --hardware h100-80gb --gpus 2048 --global-batch 1024 --search

See megazero/toolbox/plan.py for every flag.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megazero.toolbox.plan import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(hardware_dir=os.path.join(ROOT, "configs", "hardware"), spec_dir=os.path.join(ROOT, "model_specs")))
