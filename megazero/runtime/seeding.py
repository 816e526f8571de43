"""Seeding every generator a training script draws from. Local: no communication."""
from __future__ import annotations

import random

import torch


def set_random_seed(seed: int) -> None:
    """DeepSpeed's `deepspeed.runtime.utils.set_random_seed`: seed Python's `random`, NumPy's global
    generator (when NumPy is installed) and torch (every device) with the same `seed`."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)
