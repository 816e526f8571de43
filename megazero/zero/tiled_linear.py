"""DeepSpeed's `zero.TiledLinear`: one linear layer stored as in_splits x out_splits tiles, each its
own module, so that ZeRO-3 gathers one tile at a time (each tile is an element of a ModuleList, hence
a gathering unit: `megazero.engine.factories.zero_units`) instead of the whole weight at once.
Local computation only; the gathers are ZeRO-3's."""
from __future__ import annotations

import torch
from torch import nn


def _splits(n: int, parts: int, what: str) -> list[int]:
    if parts < 1 or parts > n:
        raise ValueError(f"TiledLinear({what}={parts}): must be between 1 and the feature count {n}")
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class TiledLinear(nn.Module):
    """`y = x W^T + b` with W (out_features, in_features) cut into out_splits x in_splits tiles.

    DeepSpeed's arguments: `in_splits`, `out_splits` (the tiles; uneven splits are balanced),
    `input_is_already_split` (x is a list of in_splits tensors), `combine_out_splits` (False: return
    the list of out_splits outputs), `linear_cls` (the tile class, built as
    ``linear_cls(in, out, bias=..., **kwargs)``), `init_linear` (an existing linear whose weight and
    bias the tiles copy). The bias lives in the tiles of the first input split."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls=nn.Linear, init_linear=None, **kwargs):
        super().__init__()
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.in_parts, self.out_parts = _splits(in_features, in_splits, "in_splits"), \
            _splits(out_features, out_splits, "out_splits")
        self.input_is_already_split, self.combine_out_splits = input_is_already_split, combine_out_splits
        self.linears = nn.ModuleList(  # tile (row r, column c) at index r * in_splits + c
            linear_cls(i, o, bias=bias and c == 0, **kwargs)
            for o in self.out_parts for c, i in enumerate(self.in_parts))
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def tile(self, row: int, col: int) -> nn.Module:
        return self.linears[row * len(self.in_parts) + col]

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Copy `other`'s weight (out_features, in_features) and bias into the tiles."""
        if tuple(other.weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"TiledLinear init_linear: weight {tuple(other.weight.shape)}, expected "
                             f"{(self.out_features, self.in_features)}")
        rows = other.weight.split(self.out_parts, dim=0)
        for r, row in enumerate(rows):
            for c, block in enumerate(row.split(self.in_parts, dim=1)):
                self.tile(r, c).weight.copy_(block)
        if self.use_bias:
            if getattr(other, "bias", None) is None:
                raise ValueError("TiledLinear(bias=True) init_linear: the linear has no bias")
            for r, b in enumerate(other.bias.split(self.out_parts)):
                self.tile(r, 0).bias.copy_(b)

    def forward(self, x):
        inputs = list(x) if self.input_is_already_split else x.split(self.in_parts, dim=-1)
        if len(inputs) != len(self.in_parts):
            raise ValueError(f"TiledLinear: {len(inputs)} input splits, expected {len(self.in_parts)}")
        outs = []
        for r in range(len(self.out_parts)):
            y = self.tile(r, 0)(inputs[0])
            for c in range(1, len(self.in_parts)):
                y = y + self.tile(r, c)(inputs[c])
            outs.append(y)
        return torch.cat(outs, dim=-1) if self.combine_out_splits else outs
