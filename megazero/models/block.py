"""The MLP and the pre-norm transformer block.

MLP: GPT ``fc1`` (column-parallel) -> GeLU / ReLU -> ``fc2`` (row-parallel); Llama SwiGLU
``down(silu(gate(x)) * up(x))`` with gate and up column-parallel. The column-parallel GEMMs of one
MLP share ONE entry into the TP region, so an MLP does one all-reduce forward and one backward
(all-gather + reduce-scatter under sequence parallelism).

Block (global index i): ``x + attn(attn_norm(x))`` then ``x + mlp(mlp_norm(x))``; the norms run on the
replicated (or, under sequence parallelism, sequence-sharded) residual stream.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazero.models.attention import SelfAttention
from megazero.models.common import LayerContext, Norm
from megazero.moe.layer import MoELayer
from megazero.runtime.comm import single_rank_group
from megazero.tensor_parallel import ColumnParallelLinear, RowParallelLinear, column_parallel_region

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class MLP(nn.Module):
    """Feed-forward network of global layer `index`.

    Logical parameters: ``layers.i.mlp.fc1`` (ffn, h) and ``layers.i.mlp.fc2`` (h, ffn) for GeLU/ReLU;
    ``layers.i.mlp.gate``, ``.up`` (ffn, h) and ``.down`` (h, ffn) for SwiGLU. Input and output
    (s, b, h) [(s/t, b, h) under sequence parallelism]; hidden dropout at site ``layers.i.mlp.dropout``.
    """

    def __init__(self, lctx: LayerContext, index: int):
        super().__init__()
        spec = lctx.spec
        self.tp_group, self.sequence_parallel, self.activation = lctx.tp_group, lctx.sequence_parallel, spec.activation
        p = f"layers.{index}.mlp"
        col = dict(tp_group=lctx.tp_group, bias=spec.bias, sequence_parallel=lctx.sequence_parallel, comm_input=False)
        row = dict(tp_group=lctx.tp_group, bias=spec.bias, input_is_parallel=True,
                   sequence_parallel=lctx.sequence_parallel)
        if spec.activation == "swiglu":
            self.gate = ColumnParallelLinear(spec.hidden, spec.ffn, **col, **lctx.linear_kwargs(f"{p}.gate"))
            self.up = ColumnParallelLinear(spec.hidden, spec.ffn, **col, **lctx.linear_kwargs(f"{p}.up"))
            self.down = RowParallelLinear(spec.ffn, spec.hidden, **row, **lctx.linear_kwargs(f"{p}.down", lctx.output_std))
        else:
            self.fc1 = ColumnParallelLinear(spec.hidden, spec.ffn, **col, **lctx.linear_kwargs(f"{p}.fc1"))
            self.fc2 = RowParallelLinear(spec.ffn, spec.hidden, **row, **lctx.linear_kwargs(f"{p}.fc2", lctx.output_std))
        self.dropout = lctx.hidden_dropout(f"{p}.dropout", spec.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (s, b, h): one column-parallel region for the MLP; see SelfAttention.forward
        if self.activation == "swiglu":
            gate, up = column_parallel_region(x, (self.gate, self.up))  # (s, b, ffn/t) each
            y = self.down(F.silu(gate) * up)
        else:
            (inner,) = column_parallel_region(x, (self.fc1,))  # (s, b, ffn/t)
            y = self.fc2(_ACTIVATIONS[self.activation](inner))
        return self.dropout(y)


def moe_mlp(lctx: LayerContext, index: int) -> nn.Module:
    """The MoE MLP of block `index` (``layers.i.mlp.router``, ``.experts.*``, ``.shared.*``): experts split
    over `lctx.ep_group` and, with expert tensor parallelism, their ffn over `lctx.expert_tp_group` (else
    replicated over TP: every TP rank routes the same tokens the same way), with the MLP biases when the
    spec has them, then the hidden dropout the dense MLP applies (site ``layers.i.mlp.dropout``)."""
    spec = lctx.spec
    return nn.Sequential(MoELayer(spec.moe, spec.hidden, lctx.ep_group or single_rank_group("ep"),
                                  f"layers.{index}.mlp", lctx.seed, spec.init_std, lctx.output_std, lctx.device,
                                  lctx.dtype, expert_tp_group=lctx.expert_tp_group, bias=spec.bias,
                                  decisions=lctx.decisions, cp_group=lctx.cp_group),
                         lctx.hidden_dropout(f"layers.{index}.mlp.dropout", spec.dropout))


class TransformerBlock(nn.Module):
    """One pre-norm decoder block, global index `index`: hidden (s, b, h) -> hidden (same shape;
    (s/t, b, h) under sequence parallelism). TP communication per micro-batch: 2 all-reduces of
    (s, b, h) forward and 2 backward, i.e. 8·b·s·h·(t−1)/t elements per rank counted by comm stats
    (with sequence parallelism: all-gathers + reduce-scatters of the same total)."""

    def __init__(self, lctx: LayerContext, index: int):
        super().__init__()
        self.index = index
        self.attn_norm = Norm(lctx, f"layers.{index}.attn_norm")
        self.attn = SelfAttention(lctx, index)
        self.mlp_norm = Norm(lctx, f"layers.{index}.mlp_norm")
        self.mlp = MLP(lctx, index) if lctx.spec.moe is None else moe_mlp(lctx, index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))
