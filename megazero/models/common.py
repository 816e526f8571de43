"""What every model layer needs to build itself: the spec, the TP group, seeds, dtype, device.

`LayerContext` is passed to each layer's constructor (never stored globally). Norm layers call the
kernel dispatch point `megazero.runtime.kernels` (fused kernel on GPU, PyTorch reference on CPU).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from megazero.runtime import kernels
from megazero.runtime.comm import GroupHandle
from megazero.core.spec import ModelSpec
from megazero.models.rope import RopeTables
from megazero.tensor_parallel import REPLICATED_STREAM, TP_STREAM, Dropout, RNGStatesTracker, ShardInfo, make_param
from megazero.tensor_parallel.weight_grad import WeightGradStore


@dataclass(frozen=True, eq=False)
class LayerContext:
    """Construction arguments shared by every layer of one model (one pipeline stage may hold a few)."""

    spec: ModelSpec
    tp_group: GroupHandle
    seed: int
    sequence_parallel: bool
    tracker: RNGStatesTracker
    device: torch.device
    dtype: torch.dtype = torch.float32
    wgrad_store: WeightGradStore | None = None  # zero bubble: linears defer their weight GEMMs to W
    attention_core: Callable[[str], Callable | None] | None = None  # name -> selective-checkpoint wrapper
    rope_tables: RopeTables | None = None  # position='rope': the model's cos/sin tables, shared by its layers
    ep_group: GroupHandle | None = None  # MoE: the expert-parallel group (None: every expert here)
    expert_tp_group: GroupHandle | None = None  # MoE: the TP group experts' ffn is split over (None: whole experts)
    decisions: object | None = None  # MoE: the checkpointer's `Decisions` (a recompute replays the routing)
    alibi_bias: object | None = None  # position='alibi': the model's `attention.AlibiBias`, shared by its layers
    cp_group: GroupHandle | None = None  # context parallel: the ranks holding other tokens of the same sequences
    cp_method: str = "ring"  # how attention sees the whole sequence then: ring | ulysses (megazero.context_parallel)
    packed: object | None = None  # packed documents: the model's `packed.PackedDocuments` (None: one document per sample)

    @property
    def tp_size(self) -> int:
        return self.tp_group.size

    @property
    def tp_rank(self) -> int:
        return self.tp_group.rank

    def linear_kwargs(self, name: str, std: float | None = None) -> dict:
        """Keyword arguments for a Column/RowParallelLinear named `name`."""
        return dict(name=name, seed=self.seed, init_std=self.spec.init_std if std is None else std,
                    device=self.device, dtype=self.dtype, wgrad_store=self.wgrad_store)

    @property
    def output_std(self) -> float:
        """Init std of projections that write into the residual stream (GPT-2 scaled init)."""
        s = self.spec
        return s.init_std / math.sqrt(2.0 * s.layers) if s.scaled_init else s.init_std

    def replicated_param(self, shape, name: str, init: str, std: float | None = None) -> nn.Parameter:
        """A parameter replicated across TP (norms, position embeddings). Under sequence parallelism
        its gradient is a partial sum per rank (marked ``sequence_parallel``)."""
        p = make_param(shape, logical_name=name, full_shape=shape, tp_dim=None, tp_rank=self.tp_rank,
                       tp_size=self.tp_size, init=init, seed=self.seed,
                       std=self.spec.init_std if std is None else std, device=self.device, dtype=self.dtype)
        p.sequence_parallel = self.sequence_parallel
        return p

    def hidden_dropout(self, site: str, p: float) -> Dropout:
        """Dropout on the residual stream: replicated across TP ranks, or one sequence chunk per rank
        under sequence parallelism (dim 0 of (seq, batch, hidden))."""
        if self.sequence_parallel and self.tp_size > 1:
            return Dropout(p, self.tracker, TP_STREAM, site, ShardInfo(0, self.tp_rank, self.tp_size))
        return Dropout(p, self.tracker, REPLICATED_STREAM, site, None)


class Norm(nn.Module):
    """LayerNorm (weight, bias) or RMSNorm (weight) over the last dim, through `megazero.runtime.kernels`.

    Parameters are replicated across TP; logical names ``{name}.weight`` and ``{name}.bias``.
    """

    def __init__(self, lctx: LayerContext, name: str):
        super().__init__()
        spec = lctx.spec
        self.kind, self.eps = spec.norm, spec.eps
        self.weight = lctx.replicated_param((spec.hidden,), f"{name}.weight", "ones")
        self.bias = lctx.replicated_param((spec.hidden,), f"{name}.bias", "zeros") if spec.norm == "layernorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layernorm":
            return kernels.layer_norm(x, self.weight, self.bias, self.eps)
        return kernels.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.kind}, eps={self.eps}"
