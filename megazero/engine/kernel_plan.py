"""The kernels a run will use, resolved from its config and loaded before the first collective.

`megazero.initialize` calls `load_kernels` before `init_distributed`: every rank builds or loads its extensions
(the norm of the model spec, the causal softmax where attention dropout runs it, the Adam step on the
optimizer's device) while no peer waits in a collective. No communication: ranks of a node that share a cache
directory take turns on its file lock (`megazero.runtime.kernels.build.build_lock`).
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from megazero.core.config import Config
from megazero.core.spec import spec_of
from megazero.pipeline.pipeline_module import PipelineModule
from megazero.runtime.kernels import prepare


def kernel_ops(cfg: Config, model=None) -> list[str]:
    """The kernel ops (`megazero.runtime.kernels.OPS` names) the run calls: the spec's norm and, with attention
    dropout, the causal softmax (megazero's attention runs SDPA otherwise); both norms and the softmax for a
    model megazero cannot see into; adam_step unless the optimizer is SGD."""
    spec = None
    if isinstance(model, PipelineModule):
        spec = model.model_spec
    elif not isinstance(model, nn.Module) and (model is not None or cfg.model.spec is not None):
        spec = spec_of(cfg) if model is None else spec_of(_with_spec(cfg, model))
    if spec is None:
        ops = ["layer_norm", "rms_norm", "scaled_upper_triang_masked_softmax"]
    else:
        ops = [prepare.NORM_OPS[spec.norm]]
        if spec.attention_dropout > 0:
            ops.append("scaled_upper_triang_masked_softmax")
    if cfg.optimizer.type != "sgd":
        ops.append("adam_step")
    return ops


def _with_spec(cfg: Config, spec_ref: str) -> Config:
    import dataclasses

    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, spec=spec_ref))


def load_kernels(cfg: Config, model, device: torch.device, rank: int) -> dict[str, str]:
    """Resolve and load the run's kernels on `device` (the Adam step on the CPU under optimizer offload) and
    return {op: backend}; global rank 0 (`rank`: this process's) prints one line naming them (a failed build
    prints its own line on the rank that saw it). No communication: call it before any process group or collective."""
    adam_device = torch.device("cpu") if cfg.zero.offload_optimizer.device == "cpu" else device
    plan = prepare.prepare(device, kernel_ops(cfg, model), adam_device)
    if rank == 0:
        print(prepare.describe(plan, device), file=sys.stderr, flush=True)
    return plan
