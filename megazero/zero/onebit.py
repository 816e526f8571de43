"""1-bit Adam's communication: the error-compensated 1-bit average of a flat tensor over a group
(Tang et al. 2021, "1-bit Adam"; DeepSpeed's OneBitAdam and its compressed all-reduce).

After the warm-up, each data-parallel rank updates Adam's momentum with its own (unreduced) gradient,
and the ranks average the momentum instead of the gradient, in one bit per element:

1. worker: x + e_w (its error from the last step) becomes sign · s_w, s_w = ‖x + e_w‖₂ / √numel (the
   scale that keeps the norm); e_w takes what the signs lost. The signs, packed 8 per byte, go by
   all-to-all (chunk j to rank j), the scales by all-gather;
2. server (every rank, for its chunk): the mean of the n workers' sign · s_w, plus its own error
   e_s, is compressed the same way (e_s keeps the loss); its packed signs and scale are all-gathered;
3. every rank unpacks the n server chunks: the same averaged tensor on every rank.

Each parameter (each part of one, where a rank's chunk boundary cuts it) has its own scale, as
DeepSpeed's per-parameter compression. Bytes per rank and call, for P elements padded to a multiple of
8n and S scales: (n−1)/n·P/8 (all-to-all) plus (n−1)/n·P/8 (all-gather) plus 4·(n−1)·S (worker
scales, all-gathered) and 8·(n−1)/n·S (server scales, all-reduced), against 2(n−1)/n·4P for an fp32
all-reduce: 32x fewer while S ≪ P. The errors are per rank and persist between steps (`state_dict`).
"""
from __future__ import annotations

import math

import torch

from megazero.runtime import comm
from megazero.runtime.comm import GroupHandle

_BITS = (128, 64, 32, 16, 8, 4, 2, 1)  # the value of each sign's bit in its byte, most significant first


def _bits(device) -> torch.Tensor:
    return torch.tensor(_BITS, dtype=torch.uint8, device=device)


def pack_signs(nonnegative: torch.Tensor) -> torch.Tensor:
    """(8k,) bool -> (k,) uint8, 8 signs per byte (most significant bit first; 1 = non-negative)."""
    return (nonnegative.view(-1, 8).to(torch.uint8) * _bits(nonnegative.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """(k,) uint8 -> (8k,) float32 of ±1 (the inverse of `pack_signs`)."""
    bits = packed.unsqueeze(1).bitwise_and(_bits(packed.device)).ne(0)  # (k, 8)
    return bits.view(-1).to(torch.float32).mul_(2).sub_(1)


def _segments(bounds: list[int]) -> list[tuple[int, int]]:
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _compress(x: torch.Tensor, error: torch.Tensor, segments: list[tuple[int, int]], lens: torch.Tensor):
    """(non-negative mask, one scale per segment) of x + error in one bit per element: each segment's
    elements become ±‖its part‖₂/√len; `error` becomes what was lost. Segments cover x in order;
    `lens` (segments,) their lengths on x's device. No host synchronisation."""
    x = x + error
    norms = torch.stack(torch._foreach_norm([x[a:b] for a, b in segments]))  # one fused pass
    scales = norms / lens.sqrt()
    signs = x >= 0
    full = torch.repeat_interleave(scales, lens, output_size=x.numel())
    error.copy_(x - torch.where(signs, full, -full))
    return signs, scales


class CompressedAverage:
    """The 1-bit average over `group` of flat fp32 tensors of `numel` elements (module docstring), with
    this rank's worker and server errors. `starts`: where the tensors' parameters begin; every parameter
    gets its own scale (and so does each part of one split between two ranks' chunks), so that a layer
    norm's gains are not scaled like an embedding. Collective: every member calls it with its own tensor."""

    def __init__(self, numel: int, group: GroupHandle, device=None, starts=(0,)):
        self.numel, self.group = numel, group
        n = group.size
        self.padded = -(-numel // (8 * n)) * 8 * n  # whole bytes in every rank's chunk
        self.chunk = self.padded // n
        chunks = [j * self.chunk for j in range(n + 1)]
        self.segments = _segments(sorted(set(starts) | set(chunks) | {numel}))  # never across a chunk
        lo, hi = group.rank * self.chunk, (group.rank + 1) * self.chunk
        self.mine = [i for i, (a, b) in enumerate(self.segments) if lo <= a and b <= hi]  # this rank's chunk
        self.worker_error = torch.zeros(self.padded, dtype=torch.float32, device=device)
        self.server_error = torch.zeros(self.chunk, dtype=torch.float32, device=device)
        # on the device once: each step indexes with them without a host-to-device copy
        lo = group.rank * self.chunk
        self.my_segments = [(self.segments[i][0] - lo, self.segments[i][1] - lo) for i in self.mine]  # in the chunk
        self.lens = torch.tensor([b - a for a, b in self.segments], device=device)
        self.my_lens = torch.tensor([b - a for a, b in self.my_segments], device=device)
        self.my_index = torch.tensor(self.mine, dtype=torch.long, device=device)

    def __call__(self, x: torch.Tensor) -> None:
        """Replace `x` (numel fp32 elements) by the ranks' compressed average, in place."""
        g, n = self.group, self.group.size
        if n == 1:
            return  # one rank: its momentum is the average (DeepSpeed compresses only between ranks too)
        buf = torch.zeros(self.padded, dtype=torch.float32, device=x.device)
        buf[:self.numel] = x.view(-1)
        signs, scales = _compress(buf, self.worker_error, self.segments, self.lens)
        packed = pack_signs(signs)  # (padded/8,): n chunks of chunk/8 bytes
        arrived = torch.empty_like(packed)
        comm.all_to_all_single(arrived, packed, g)  # chunk j to rank j: (n, chunk/8) from every worker
        every_scale = scales.new_empty(n * scales.numel())
        comm.all_gather(every_scale, scales, g)
        worker_scales = every_scale.view(n, -1).index_select(1, self.my_index)  # (n, my segments)
        per_element = torch.repeat_interleave(worker_scales, self.my_lens, dim=1, output_size=self.chunk)  # (n, chunk)
        workers = unpack_signs(arrived).view(n, self.chunk) * per_element
        s_signs, s_scales = _compress(workers.mean(0), self.server_error, self.my_segments, self.my_lens)
        everyone = torch.empty_like(packed)
        comm.all_gather(everyone, pack_signs(s_signs), g)
        server_scales = scales.new_zeros(scales.numel())  # every segment is one rank's: the others add 0
        server_scales.index_copy_(0, self.my_index, s_scales)
        comm.all_reduce(server_scales, g)
        averaged = unpack_signs(everyone) * torch.repeat_interleave(server_scales, self.lens,
                                                                    output_size=self.padded)  # rank order
        x.view(-1).copy_(averaged[:self.numel])

    def state_dict(self) -> dict:
        return {"worker_error": self.worker_error.clone(), "server_error": self.server_error.clone()}

    def load_state_dict(self, sd: dict) -> None:
        self.worker_error.copy_(sd["worker_error"])
        self.server_error.copy_(sd["server_error"])


class OneBitAdam:
    """1-bit Adam (DeepSpeed's OneBitAdam) for a `ZeroOptimizer`'s stage-0 flat `groups`: one
    `CompressedAverage` per flat bucket over its group's dp (scales per parameter), and the update.

    Adam step t: m = β1·m + (1−β1)·g; during the `freeze_step` warm-up steps also v = β2·v + (1−β2)·g²
    (g the reduced gradient). After it v stays frozen, and m, of this rank's own unreduced gradient,
    is averaged over dp in 1 bit, then zeroed where v is 0 (DeepSpeed's exp_avg_mask, which its users
    pass by hand for such parameters: padded vocabulary rows, unused tokens). The update is
    p −= lr·(m̂ / (√v̂ + eps) + wd·p) with Adam's bias corrections m̂ = m/(1−β1^t) and v̂ = v/(1−β2^t')
    (t' = min(t, freeze_step): the frozen v keeps its correction); without `bias_correction` m̂ = m and
    v̂ = v, as DeepSpeed's (which applies none)."""

    def __init__(self, groups, freeze_step: int, bias_correction: bool = True, device=None):
        if any(g.stage != 0 for g in groups):
            raise ValueError("optimizer.type=onebit_adam needs zero.stage 0: its ranks average the momentum of "
                             "whole gradients, which stages 1-3 shard")
        if any(g.grad_divisor != g.dp.size for g in groups):
            raise ValueError("optimizer.type=onebit_adam: not with expert parallelism (parallel.ep > 1), whose experts "
                             "average over a smaller group than their momentum would")
        if freeze_step < 1:
            raise ValueError(f"optimizer.freeze_step={freeze_step}: 1-bit Adam needs at least 1 warm-up step "
                             f"(the variance it freezes)")
        self.freeze_step, self.bias_correction = freeze_step, bias_correction
        self.groups = list(groups)
        self.averages = {id(g): [CompressedAverage(m.numel(), g.dp, device,
                                                   [seg.buf_start - bk.start for seg in g.segments[bk.index]])
                                 for m, bk in zip(g.exp_avg, g.layout.buckets)] for g in self.groups}

    def compressing(self, steps_taken: int) -> bool:
        """Whether the next step (after `steps_taken`) is past the warm-up: gradients stay unreduced."""
        return steps_taken >= self.freeze_step

    def update(self, group, runs, buckets, grads, step: int, param_groups) -> None:
        """The update of `group`'s `buckets` at Adam step `step` (class docstring): `runs[b]` the
        (start, end, parameter group) runs of bucket b, `grads[b]` its gradient; after the warm-up one
        compressed average per bucket over the group's dp."""
        frozen = step > self.freeze_step
        for b in buckets:
            for a, e, g in runs[b]:
                beta1, beta2 = param_groups[g]["betas"]
                m, v, gr = group.exp_avg[b][a:e], group.exp_avg_sq[b][a:e], grads[b][a:e]
                m.mul_(beta1).add_(gr, alpha=1 - beta1)
                if not frozen:
                    v.mul_(beta2).addcmul_(gr, gr, value=1 - beta2)
            if frozen:
                self.averages[id(group)][b](group.exp_avg[b])
            for a, e, g in runs[b]:
                h = param_groups[g]
                beta1, beta2 = h["betas"]
                p, m, v = group.master[b][a:e], group.exp_avg[b][a:e], group.exp_avg_sq[b][a:e]
                if frozen:
                    m.masked_fill_(v == 0, 0.0)
                c1 = 1 - beta1 ** step if self.bias_correction else 1.0
                c2 = 1 - beta2 ** min(step, self.freeze_step) if self.bias_correction else 1.0
                update = (m / c1) / ((v / c2).sqrt() + h["eps"])
                if h["weight_decay"]:
                    update.add_(p, alpha=h["weight_decay"])
                p.add_(update, alpha=-h["lr"])

    def _keys(self):
        for gi, g in enumerate(self.groups):
            for b, avg in enumerate(self.averages[id(g)]):
                yield f"onebit/{gi}/{b}/", avg

    def state(self) -> dict[str, torch.Tensor]:
        """This rank's worker and server errors, ``onebit/<group>/<bucket>/<name>``: copies."""
        return {prefix + k: t for prefix, avg in self._keys() for k, t in avg.state_dict().items()}

    def load_state(self, saved: dict[str, torch.Tensor]) -> None:
        """Restore what `state()` saved in the same layout. What was not saved, or saved for another
        bucketing, starts afresh (zero errors: 1-bit Adam resumed from an Adam checkpoint)."""
        for prefix, avg in self._keys():
            mine = avg.state_dict()
            if all(prefix + k in saved and saved[prefix + k].shape == t.shape for k, t in mine.items()):
                avg.load_state_dict({k: saved[prefix + k] for k in mine})

    def error_bytes(self) -> int:
        """Bytes of error feedback held: 4·(P + P/dp) per bucket of P elements padded to 8·dp."""
        return sum(4 * (avg.worker_error.numel() + avg.server_error.numel())
                   for avgs in self.averages.values() for avg in avgs)


__all__ = ["CompressedAverage", "OneBitAdam", "pack_signs", "unpack_signs"]
