"""Tensor-parallel layers: column- and row-parallel linear layers and the vocabulary-parallel embedding.

Activations are laid out (seq, batch, hidden). Under sequence parallelism the activations between
TP regions are sequence shards (seq/tp, batch, hidden): a column-parallel layer all-gathers them
along the sequence on entry and a row-parallel layer reduce-scatters on exit, instead of f and g.

Parameters are created by `megazero.tensor_parallel.init.make_param`: layout-invariant values and the
metadata (logical_name, tp_dim, ...) described there. `name` is the logical prefix of the layer's
parameters (``"layers.5.attn.q"`` gives ``"layers.5.attn.q.weight"``); `seed` and `init_std` drive the
initialization.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazero.runtime.comm import GroupHandle
from megazero.tensor_parallel import mappings
from megazero.tensor_parallel.column_region import column_region
from megazero.tensor_parallel.init import local_size, make_param, padded_size
from megazero.tensor_parallel.weight_grad import WeightGradStore, linear


class ColumnParallelLinear(nn.Module):
    """y = x Aᵀ + b with A split by rows (output features) across `tp_group`: rank r computes output
    features [r·out/t, (r+1)·out/t).

    Communication over `tp_group`: entering the region, f (identity forward, all-reduce of the input
    gradient backward) or, with `sequence_parallel`, an all-gather of the sequence forward and a
    reduce-scatter backward, the backward reduction overlapped with the weight-gradient GEMM
    (`column_parallel_region`); none when ``comm_input=False`` (the caller already entered the region
    with `mappings.enter_column_region`; `column_parallel_region` is the overlapped way to share one
    region among q, k and v). With `gather_output` the output is all-gathered along the last dim
    (forward) and split (backward).

    Shapes: input (..., in_features) [(seq/t, b, in) under sequence parallelism];
    output (..., out_features/t), or (..., out_features) with gather_output.
    """

    def __init__(self, in_features: int, out_features: int, tp_group: GroupHandle, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, *, name: str = "linear",
                 seed: int = 0, init_std: float = 0.02, comm_input: bool = True, device=None,
                 dtype: torch.dtype = torch.float32, wgrad_store: WeightGradStore | None = None):
        super().__init__()
        t = tp_group.size
        self.in_features, self.out_features, self.tp_group = in_features, out_features, tp_group
        self.gather_output, self.sequence_parallel, self.comm_input = gather_output, sequence_parallel, comm_input
        out_local = local_size(out_features, t, f"{name}: out_features")
        common = dict(tp_rank=tp_group.rank, tp_size=t, seed=seed, device=device, dtype=dtype)
        self.weight = make_param((out_local, in_features), logical_name=f"{name}.weight",
                                 full_shape=(out_features, in_features), tp_dim=0, init="normal",
                                 std=init_std, **common)
        self.bias = make_param((out_local,), logical_name=f"{name}.bias", full_shape=(out_features,),
                               tp_dim=0, init="zeros", **common) if bias else None
        self.wgrad_store = wgrad_store  # defers the weight-grad GEMM to W (zero bubble); None: in B

    def forward(self, x: torch.Tensor, regather=None) -> torch.Tensor:
        """`regather`: the region's handle from `mappings.enter_column_region` (then x is the
        already gathered input, and only the shard is kept for backward)."""
        if self.comm_input and self.tp_group.size > 1:
            return column_parallel_region(x, (self,))[0]
        y = linear(x, self.weight, self.bias, self.wgrad_store, regather)  # (..., out/t)
        return mappings.gather_from_tp_region(y, self.tp_group) if self.gather_output else y  # (..., out)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp_group.size}, "
                f"sequence_parallel={self.sequence_parallel}, gather_output={self.gather_output}")


def column_parallel_region(x: torch.Tensor, linears) -> tuple[torch.Tensor, ...]:
    """The outputs of the column-parallel `linears` of ONE region on the same input x: q, k and v (or
    gate and up) enter the region once. They must share tp_group, sequence_parallel and wgrad_store;
    their own comm_input is not used.

    Communication over that tp_group: forward, none (f) or, with sequence parallelism, one all-gather
    of the sequence; backward, one all-reduce (one reduce-scatter) of the input gradient summed over
    the linears, in flight while their weight-gradient GEMMs run (`column_region.column_region`);
    then each output with `gather_output` is all-gathered along the last dim.

    With one TP rank each linear is called as a module (nothing to overlap; hooks on it, such as
    ZeRO-3's per-module gathering under ModuleEngine, run as usual). With more, the region is one
    autograd node that reads every linear's parameters: the linears' own module hooks do not run, so
    a hook that must see them belongs on an enclosing module (PipelineModule's ZeRO-3 units are layers).

    Shapes: x (s, b, in) [(s/t, b, in) under sequence parallelism]; output i (s, b, out_i/t), or
    (s, b, out_i) with gather_output.
    """
    first = linears[0]
    for lin in linears[1:]:
        if (lin.tp_group is not first.tp_group or lin.sequence_parallel != first.sequence_parallel
                or lin.wgrad_store is not first.wgrad_store):
            raise ValueError("column_parallel_region: the linears of one region must share tp_group, "
                             "sequence_parallel and wgrad_store")
    if first.tp_group.size == 1:
        return tuple(lin(x) for lin in linears)
    ys = column_region(x, [lin.weight for lin in linears], [lin.bias for lin in linears], first.tp_group,
                       first.sequence_parallel, first.wgrad_store)  # (s, b, out_i/t) each
    return tuple(mappings.gather_from_tp_region(y, lin.tp_group) if lin.gather_output else y
                 for y, lin in zip(ys, linears))


class RowParallelLinear(nn.Module):
    """y = x Aᵀ + b with A split by columns (input features) across `tp_group`.

    Communication over `tp_group`: if not `input_is_parallel`, the input's last dim is first split
    (all-gather of its gradient backward). The partial products are summed by g (all-reduce forward,
    identity backward) or, with `sequence_parallel`, reduce-scattered along the sequence (all-gather
    backward). The bias is replicated and added after the reduction; under sequence parallelism its
    gradient is partial per rank (``bias.sequence_parallel = True``).

    Shapes: input (s, b, in/t) (or (..., in) when not input_is_parallel); output (s, b, out), or
    (s/t, b, out) under sequence parallelism.
    """

    def __init__(self, in_features: int, out_features: int, tp_group: GroupHandle, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, *, name: str = "linear",
                 seed: int = 0, init_std: float = 0.02, device=None, dtype: torch.dtype = torch.float32,
                 wgrad_store: WeightGradStore | None = None):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError(f"{name}: sequence_parallel needs input_is_parallel=True")
        t = tp_group.size
        self.in_features, self.out_features, self.tp_group = in_features, out_features, tp_group
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        in_local = local_size(in_features, t, f"{name}: in_features")
        common = dict(tp_rank=tp_group.rank, tp_size=t, seed=seed, device=device, dtype=dtype)
        self.weight = make_param((out_features, in_local), logical_name=f"{name}.weight",
                                 full_shape=(out_features, in_features), tp_dim=1, init="normal",
                                 std=init_std, **common)
        self.bias = None
        if bias:
            self.bias = make_param((out_features,), logical_name=f"{name}.bias", full_shape=(out_features,),
                                   tp_dim=None, init="zeros", **common)
            self.bias.sequence_parallel = sequence_parallel
        self.wgrad_store = wgrad_store  # defers the weight-grad GEMM to W (zero bubble); None: in B

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = mappings.scatter_to_tp_region(x, self.tp_group)
        y = linear(x, self.weight, None, self.wgrad_store)  # (s, b, out) partial sum over the TP group
        y = mappings.exit_tp_region(y, self.tp_group, self.sequence_parallel)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp_group.size}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows across `tp_group`.

    The table is padded to `padded_vocab` = a multiple of tp·`vocab_align`; rank r holds rows
    [r·padded/t, (r+1)·padded/t). Padding rows are zero and no token id reaches them (ids must be in
    [0, num_embeddings)). Each rank looks up the ids in its range (zeros elsewhere); the partial
    results are summed by g (all-reduce over `tp_group`) or, with `sequence_parallel`, reduce-scattered
    along dim 0 (the ids must then be laid out (seq, batch)).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group: GroupHandle, *,
                 vocab_align: int = 1, sequence_parallel: bool = False, name: str = "embedding.word",
                 seed: int = 0, init_std: float = 0.02, device=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        t = tp_group.size
        self.num_embeddings, self.embedding_dim, self.tp_group = num_embeddings, embedding_dim, tp_group
        self.sequence_parallel = sequence_parallel
        self.padded_vocab = padded_size(num_embeddings, t, vocab_align)
        self.per_rank = self.padded_vocab // t
        self.vocab_start = tp_group.rank * self.per_rank
        self.weight = make_param((self.per_rank, embedding_dim), logical_name=f"{name}.weight",
                                 full_shape=(num_embeddings, embedding_dim), tp_dim=0, init="normal",
                                 std=init_std, tp_rank=tp_group.rank, tp_size=t, seed=seed,
                                 device=device, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (*ids.shape, h)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return mappings.exit_tp_region(out, self.tp_group, self.sequence_parallel)

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings} (padded {self.padded_vocab}), dim={self.embedding_dim}, "
                f"tp={self.tp_group.size}")
