"""The routed experts of one MoE layer held by one expert-parallel rank, run as a group.

Parameters are stacked over this rank's E/P experts: GeLU / ReLU ``fc1`` (E/P, f, h) and ``fc2`` (E/P, h, f);
SwiGLU ``gate`` and ``up`` (E/P, f, h) and ``down`` (E/P, h, f). Their logical tensors are (E, ...),
split over the ep group on dim 0 (``ep_dim = 0``). With biases (the model's MLP biases): ``fc1_bias``,
``gate_bias``, ``up_bias`` (E/P, f) and ``fc2_bias``, ``down_bias`` (E/P, h), zero-initialised.

Expert tensor parallelism (Megatron-LM's expert_tensor_parallel_size = TP): with an expert TP group of
t > 1 ranks each expert's ffn dim is split over it like the dense MLP's: gate / up / fc1 and their biases
column-parallel (shard (E/P, f/t, h), ``tp_dim = 1``), down / fc2 row-parallel (shard (E/P, h, f/t),
``tp_dim = 2``), the output biases replicated. With a group of one rank the experts are whole on every
TP rank (TP replicated, ``tp_dim`` None). Each expert's initial values depend only on the seed, the
parameter's name and the expert's global index (`megazero.tensor_parallel.init.make_param` draws the
TP shard of the logical (f, h) tensor of expert e), so every layout starts from the same model.

The routed experts run as one grouped GEMM per weight, `torch._grouped_mm` over the rows grouped by
expert with int32 offsets on the device (three GEMMs forward for SwiGLU, two for GeLU / ReLU, however
many experts), without host synchronisation; where it cannot run (an older torch, float64, ffn / t
or h rows not 16-byte aligned) as a batched matmul over the rows padded to the largest count, which
the host reads once unless the caller knows it (`GroupedExperts.forward`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazero.core.moe_spec import grouped_gemm_fits
from megazero.runtime import comm
from megazero.runtime.comm import GroupHandle, single_rank_group
from megazero.tensor_parallel.init import local_size, make_param
from megazero.tensor_parallel.mappings import copy_to_tp_region, reduce_from_tp_region


_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")
GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def expert_param(local: int, num_experts: int, ep_rank: int, shape: tuple[int, ...], name: str, seed: int,
                 std: float, device, dtype, routed: bool = True, tp_dim: int | None = None,
                 tp_group: GroupHandle | None = None, init: str = "normal") -> nn.Parameter:
    """This ep rank's `local` experts of the logical (num_experts, *shape) parameter `name`; `routed`
    False for a shared expert (one, on every rank, a dense parameter). `tp_dim` (a dim of the stacked
    tensor, 1 or 2): the dim split over `tp_group` (None, or a group of one rank: whole)."""
    tp_group = tp_group or single_rank_group("tp")
    if tp_group.size == 1:
        tp_dim = None
    t = tp_group.size if tp_dim is not None else 1
    rank = tp_group.rank if tp_dim is not None else 0
    each_shape = tuple(local_size(n, t, f"{name}: dim {d + 1}") if d + 1 == tp_dim else n for d, n in enumerate(shape))
    first = ep_rank * local
    each = [make_param(each_shape, logical_name=f"{name}[{e}]", full_shape=shape,
                       tp_dim=None if tp_dim is None else tp_dim - 1, tp_rank=rank, tp_size=t, init=init,
                       seed=seed, std=std, device=device, dtype=dtype).data
            for e in range(first, first + local)]  # expert e's values depend on (seed, name, e) only
    p = nn.Parameter(torch.stack(each))  # (local, *shape with dim tp_dim / t)
    p.logical_name, p.full_shape = name, (num_experts,) + tuple(shape)
    p.tp_dim, p.tp_rank, p.tp_size, p.sequence_parallel = tp_dim, rank, t, False  # tp_dim None: TP replicated
    if routed:
        p.ep_dim, p.ep_rank, p.ep_size = 0, ep_rank, num_experts // local
    if init == "zeros":
        p.no_weight_decay = True  # a bias, as the dense layers' (megazero.zero.param_groups)
    p.expert = routed
    return p


class GroupedExperts(nn.Module):
    """Experts ``ep_rank·local .. (ep_rank+1)·local − 1`` of a layer (global names ``{name}.fc1`` ...);
    with `routed` False, the layer's shared expert (num_experts = local = 1, dense). `tp_group`: the
    expert TP group their ffn dim is split over (None: whole experts). `bias`: the MLP biases."""

    def __init__(self, hidden: int, ffn: int, activation: str, num_experts: int, local: int, ep_rank: int,
                 name: str, seed: int, std: float, out_std: float, device=None, dtype=torch.float32,
                 routed: bool = True, tp_group: GroupHandle | None = None, bias: bool = False):
        super().__init__()
        self.activation, self.local = activation, local
        self.tp_group = tp_group or single_rank_group("tp")
        make = dict(local=local, num_experts=num_experts, ep_rank=ep_rank, seed=seed, device=device, dtype=dtype,
                    routed=routed, tp_group=self.tp_group)
        ins = ("gate", "up") if activation == "swiglu" else ("fc1",)
        out = "down" if activation == "swiglu" else "fc2"
        for n in ins:  # column-parallel
            setattr(self, n, expert_param(shape=(ffn, hidden), name=f"{name}.{n}", std=std, tp_dim=1, **make))
            setattr(self, f"{n}_bias", expert_param(shape=(ffn,), name=f"{name}.{n}_bias", std=0.0, tp_dim=1,
                                                    init="zeros", **make) if bias else None)
        setattr(self, out, expert_param(shape=(hidden, ffn), name=f"{name}.{out}", std=out_std, tp_dim=2, **make))
        self.out_bias_name = f"{out}_bias"
        setattr(self, self.out_bias_name, expert_param(shape=(hidden,), name=f"{name}.{out}_bias", std=0.0,
                                                       init="zeros", **make) if bias else None)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor | list[int] | None = None, padded: bool = False,
                known: list[int] | None = None) -> torch.Tensor:
        """`rows` (N, h) grouped by local expert, `counts` (local,) int64 on the device: rows per expert
        (a list of ints: the same, known on the host); None: every row to the one expert (the shared
        experts: plain GEMMs). `padded`: rows may follow the counted ones (N ≥ Σ counts, the dropped
        assignments at ep = 1); they get zero outputs and a zero gradient. `known`: the counts on the
        host when the caller has them (they spare the fallback its synchronisation). Returns (N, h).

        The routed experts run as one grouped GEMM per weight (`torch._grouped_mm` with the counts'
        cumulative ends as int32 offsets on the device: no host synchronisation) where this torch has
        it and dtype and strides allow (`grouped_gemm_fits`; on a GPU also 16-byte aligned pointers);
        else as a batched matmul over the rows padded to the largest count (`_padded`: its one host
        synchronisation reads that count, unless `known` gives it). Biases are gathered per row.

        Communication over the expert TP group (none with one rank): f on the rows (identity forward,
        all-reduce of their gradient backward) and g on the outputs (all-reduce of the partial sums
        forward, identity backward), so the outputs are whole and the rows' gradient equal on every TP
        rank; the output bias is added after the all-reduce. Both run with N = 0 too (an ep rank no
        token was sent to): a TP rank never skips a collective its peers issue. The TP ranks hold the
        same rows: their hidden states are bit-identical (the MoE combine is deterministic,
        `megazero.moe.layer.combine`) and the replicated router decides on them alike, so the
        all-reduces' shapes, which follow `rows`, agree."""
        tp = self.tp_group
        if isinstance(counts, (list, tuple)):
            known, counts = list(counts), torch.tensor(counts, dtype=torch.long, device=rows.device)
        if tp.size > 1:
            rows = copy_to_tp_region(rows, tp)
        out_bias = getattr(self, self.out_bias_name)
        if counts is None:  # one expert takes every row
            y = self._mlp(rows, lambda x, w, b: F.linear(x, w[0], None if b is None else b[0]))
            y = reduce_from_tp_region(y, tp) if tp.size > 1 else y
            return y if out_bias is None else y + out_bias[0]
        n = rows.shape[0]
        offs = torch.cumsum(counts, 0, dtype=torch.int32)  # (local,) each expert's end row
        at = torch.arange(n, dtype=torch.int32, device=rows.device)
        valid = (at < offs[-1]).unsqueeze(1) if padded else None  # (N, 1): the counted rows
        expert = torch.searchsorted(offs, at, right=True).clamp_max_(self.local - 1)  # (N,) each row's expert
        if self.grouped(rows):
            def linear(x, w, b):  # (N, in) -> (N, out), the rows past the offsets' end zero (else garbage)
                y = _ContiguousGrad.apply(torch._grouped_mm(x, w.transpose(1, 2), offs=offs))
                y = y if b is None else y + b[expert]
                return y if valid is None else torch.where(valid, y, 0)

            y = self._mlp(rows if valid is None else torch.where(valid, rows, 0), linear)
        else:
            y = self._padded(rows, counts, offs, expert, valid, known)
        if tp.size > 1:
            y = reduce_from_tp_region(y, tp)
        if out_bias is not None:
            bias = out_bias[expert]  # (N, h): each row its expert's
            y = y + (bias if valid is None else torch.where(valid, bias, 0))
        return y

    def _mlp(self, x: torch.Tensor, linear) -> torch.Tensor:
        """The experts' MLP on `x` with `linear(x, weight, bias)` (the output bias apart: after the TP
        reduction); each (rows, ffn / t) intermediate is a partial sum's factor over the expert TP group."""
        if self.activation == "swiglu":
            inner = F.silu(linear(x, self.gate, self.gate_bias)) * linear(x, self.up, self.up_bias)
            return linear(inner, self.down, None)
        return linear(_ACTIVATIONS[self.activation](linear(x, self.fc1, self.fc1_bias)), self.fc2, None)

    def grouped(self, rows: torch.Tensor) -> bool:
        """Whether `rows` run as grouped GEMMs (`forward`): torch has `_grouped_mm`, the dtype is one it
        takes and the weights share it, the strides fit (`grouped_gemm_fits`), on a GPU the pointers are
        16-byte aligned, there is at least one row; on meta only bf16 (what its meta function allows)."""
        w = self.gate if self.activation == "swiglu" else self.fc1  # (local, f/t, h)
        if not HAS_GROUPED_MM or rows.shape[0] == 0 or rows.dtype not in GROUPED_DTYPES:
            return False
        if any(p.dtype != rows.dtype for p in self.parameters()) or not grouped_gemm_fits(
                w.shape[2], w.shape[1], rows.element_size()):
            return False
        if rows.device.type == "meta":
            return rows.dtype == torch.bfloat16
        return rows.device.type == "cpu" or all(t.data_ptr() % 16 == 0 for t in (rows, *self.parameters()))

    def _padded(self, rows, counts, offs, expert, valid, known) -> torch.Tensor:
        """The fallback: `rows` (N, h) placed into (local, C, h), C the largest count (read on the host
        unless `known`: this path's one synchronisation), through batched matmuls, and gathered back;
        rows past the counts all go to one spare row, never read (index_put accumulates: no write races),
        and get zero outputs and gradients."""
        n, h, local = rows.shape[0], rows.shape[1], self.local
        C = max(known) if known is not None else int(counts.max())  # host synchronisation (the fallback's)
        index = expert * C + (torch.arange(n, device=rows.device) - (offs - counts)[expert])  # (N,) padded row
        if valid is not None:
            index = torch.where(valid.squeeze(1), index, local * C)
        xp = rows.new_zeros(local * C + 1, h).index_put((index,), rows, accumulate=True)[:local * C]
        yp = self._mlp(xp.view(local, C, h), lambda x, w, b: torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2))
                       if b is not None else torch.bmm(x, w.transpose(1, 2)))  # (local, C, h)
        return torch.cat([yp.reshape(local * C, h), yp.new_zeros(1, h)]).index_select(0, index)  # (N, h)


class _ContiguousGrad(torch.autograd.Function):
    """Identity; backward hands on a contiguous gradient (`torch._grouped_mm`'s backward wants 16-byte
    aligned strides)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def gather_expert_tensors(tensors: dict, module: nn.Module, ep_group) -> dict:
    """`tensors` ({logical name: this rank's tensor}) with every routed-expert entry of `module`
    replaced by the whole (E, ...) tensor, all-gathered over `ep_group` along the expert dim (every
    ep rank must call; the order is the module's). For checkpoints' and parity checks' whole views
    (gather over the TP group first: `megazero.tensor_parallel.gather_full_tensors`)."""
    out = dict(tensors)
    for p in module.parameters():
        name = getattr(p, "logical_name", None)
        if getattr(p, "ep_dim", None) is None or name not in out or ep_group.size == 1:
            continue
        local = out[name].contiguous()
        whole = local.new_empty((ep_group.size * local.shape[0],) + tuple(local.shape[1:]))
        comm.all_gather(whole, local, ep_group)
        out[name] = whole
    return out


__all__ = ["GroupedExperts", "expert_param", "gather_expert_tensors"]
