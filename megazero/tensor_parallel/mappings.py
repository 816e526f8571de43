"""The conjugate communication operators of tensor parallelism, as small autograd Functions.

Every operator takes the tensor-parallel `GroupHandle` explicitly and communicates only over it,
through `megazero.runtime.comm` (so every byte is counted in ``group.stats``). With a group of one rank
every operator is the identity.

| operator                                   | forward                    | backward                   |
|--------------------------------------------|----------------------------|----------------------------|
| f  `copy_to_tp_region`                     | identity                   | all-reduce                 |
| g  `reduce_from_tp_region`                 | all-reduce                 | identity                   |
| `scatter_to_tp_region`                     | keep own chunk of last dim | all-gather along last dim  |
| `gather_from_tp_region`                    | all-gather along last dim  | keep own chunk of last dim |
| `scatter_to_sequence_parallel_region`      | keep own chunk of dim 0    | all-gather along dim 0     |
| `gather_from_sequence_parallel_region`     | all-gather along dim 0     | reduce-scatter along dim 0 |
| `reduce_scatter_to_sequence_parallel_region` | reduce-scatter along dim 0 | all-gather along dim 0   |

Sequence-parallel activations are laid out (seq, batch, hidden) so the sequence is dim 0 and
every shard is contiguous. `gather_from_sequence_parallel_region` is the entry of a column-parallel
region (the gradient arriving from the region is a partial sum per rank, hence reduce-scatter);
`reduce_scatter_to_sequence_parallel_region` is the exit of a row-parallel region.
"""
from __future__ import annotations

import torch

from megazero.runtime import comm
from megazero.runtime.comm import GroupHandle


def _all_gather_dim(x: torch.Tensor, dim: int, group: GroupHandle) -> torch.Tensor:
    """All-gather equal shards of `x` over `group` and concatenate them along `dim` in rank order."""
    n = group.size
    x = x.contiguous()
    out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)  # (n*d0, ...)
    comm.all_gather(out, x, group)
    if dim == 0:
        return out
    return torch.cat(out.chunk(n, dim=0), dim=dim)


def _split_dim(x: torch.Tensor, dim: int, group: GroupHandle) -> torch.Tensor:
    """This rank's chunk of `x` along `dim` (the size must divide evenly)."""
    n = group.size
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} evenly over a TP group of {n}")
    return x.chunk(n, dim=dim)[group.rank].contiguous()


def _reduce_scatter_dim0(x: torch.Tensor, group: GroupHandle) -> torch.Tensor:
    """Sum `x` over `group` and keep this rank's chunk of dim 0."""
    n = group.size
    if x.shape[0] % n:
        raise ValueError(f"sequence dim of size {x.shape[0]} is not divisible by the TP size {n}")
    out = torch.empty((x.shape[0] // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, x.contiguous(), group)
    return out


def _all_reduce(x: torch.Tensor, group: GroupHandle) -> torch.Tensor:
    """A copy of `x` all-reduced over `group` (for a gradient handed to backward, which another branch
    may share)."""
    x = x.contiguous().clone() if group.size > 1 else x
    comm.all_reduce(x, group)
    return x


class _CopyToTPRegion(torch.autograd.Function):
    """f: identity forward, all-reduce (sum) of the gradient over the TP group backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTPRegion(torch.autograd.Function):
    """g: all-reduce (sum) over the TP group forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        """In place, as Megatron-LM: `x` is a partial sum just computed (a row-parallel GEMM's output)
        and nothing else reads it; `mark_dirty` makes autograd refuse, loudly, any graph that saved it."""
        if group.size == 1:
            return x.view_as(x)
        if not x.is_contiguous() or x._is_view() or x.is_leaf:  # not a fresh result: reduce a copy
            return _all_reduce(x, group)
        comm.all_reduce(x, group)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTPRegion(torch.autograd.Function):
    """Keep this rank's chunk of the last dim forward; all-gather along the last dim backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_dim(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, grad.dim() - 1, ctx.group), None


class _GatherFromTPRegion(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's chunk of the last dim backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_dim(grad, grad.dim() - 1, ctx.group), None


class _ScatterToSPRegion(torch.autograd.Function):
    """Keep this rank's chunk of the sequence (dim 0) forward; all-gather along dim 0 backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, 0, ctx.group), None


class _GatherFromSPRegion(torch.autograd.Function):
    """All-gather along the sequence (dim 0) forward; reduce-scatter along dim 0 backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim0(grad, ctx.group), None


class _ReduceScatterToSPRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence (dim 0) forward; all-gather along dim 0 backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, 0, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group: GroupHandle) -> torch.Tensor:
    """f: identity forward; all-reduce of the gradient over `group` backward."""
    return x if group.size == 1 else _CopyToTPRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: GroupHandle) -> torch.Tensor:
    """g: all-reduce over `group` forward; identity backward."""
    return x if group.size == 1 else _ReduceFromTPRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: GroupHandle) -> torch.Tensor:
    """Split the last dim over `group` (keep own chunk) forward; all-gather it backward."""
    return x if group.size == 1 else _ScatterToTPRegion.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: GroupHandle) -> torch.Tensor:
    """All-gather the last dim over `group` forward; keep own chunk of the gradient backward."""
    return x if group.size == 1 else _GatherFromTPRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: GroupHandle) -> torch.Tensor:
    """Split dim 0 (sequence) over `group` forward; all-gather the gradient along dim 0 backward."""
    return x if group.size == 1 else _ScatterToSPRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: GroupHandle) -> torch.Tensor:
    """All-gather dim 0 (sequence) over `group` forward; reduce-scatter the gradient backward."""
    return x if group.size == 1 else _GatherFromSPRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: GroupHandle) -> torch.Tensor:
    """Reduce-scatter dim 0 (sequence) over `group` forward; all-gather the gradient backward."""
    return x if group.size == 1 else _ReduceScatterToSPRegion.apply(x, group)


def enter_tp_region(x: torch.Tensor, group: GroupHandle, sequence_parallel: bool) -> torch.Tensor:
    """The entry of a column-parallel region: f, or the sequence all-gather under sequence parallelism.

    One call may feed several column-parallel GEMMs (q, k and v; gate and up) so that a block does
    one all-reduce (or one all-gather) per region, not one per GEMM.
    """
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group)
    return copy_to_tp_region(x, group)


def enter_column_region(x: torch.Tensor, group: GroupHandle, sequence_parallel: bool, uses: int,
                        regather: bool = True):
    """`enter_tp_region` for a region of `uses` column-parallel GEMMs; returns (input, handle). With
    sequence parallelism and `regather`, the handle lets the GEMMs save only this rank's shard and
    all-gather it again in backward (see `weight_grad.Regather`); otherwise the handle is None.

    The entry is its own autograd node, so its backward reduction starts only after the GEMMs' whole
    backward; `layers.column_parallel_region` does the same communication overlapped with their
    weight-gradient GEMMs."""
    from megazero.tensor_parallel.weight_grad import Regather

    full = enter_tp_region(x, group, sequence_parallel)
    if sequence_parallel and regather and group.size > 1:
        return full, Regather(x, group, uses, lambda shard, tp_group: _all_gather_dim(shard, 0, tp_group))
    return full, None


def exit_tp_region(x: torch.Tensor, group: GroupHandle, sequence_parallel: bool) -> torch.Tensor:
    """The exit of a row-parallel region: g, or the sequence reduce-scatter under sequence parallelism."""
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(x, group)
    return reduce_from_tp_region(x, group)
