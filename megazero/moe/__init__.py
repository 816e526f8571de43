"""L2: Mixture-of-Experts building blocks (routing, dispatch over the expert-parallel group, grouped
experts, the MoE MLP; DeepSpeed's gating and `MoE` layer for a user's expert module, and its MoE
helpers). Import the submodules directly; ``megazero.moe.layer`` and ``megazero.moe.utils`` are also
imported on first attribute access, so that DeepSpeed's ``deepspeed.moe.layer.MoE`` spelling works after
``import megazero as deepspeed``."""
from __future__ import annotations

import importlib

_ON_ACCESS = ("layer", "utils")


def __getattr__(name: str):
    if name in _ON_ACCESS:
        return importlib.import_module(f"megazero.moe.{name}")
    raise AttributeError(f"module 'megazero.moe' has no attribute {name!r}")
