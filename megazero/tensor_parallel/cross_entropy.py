"""Cross-entropy over vocabulary-parallel logits that never gathers the full logits.

Each TP rank holds logits for vocabulary columns [r·Vp/t, (r+1)·Vp/t) of the padded vocabulary Vp;
columns >= `vocab_size` are padding and are excluded (their probability is zero and their gradient
is zero). Memory: one fp32 (tokens, Vp/t) buffer, saved for backward as the softmax and turned into the
gradient there in place (4 bytes per logit, plus the gradient's copy in a 16-bit logits' dtype).
Communication over `tp_group`, forward only: one all-reduce (max) of a (tokens,) tensor for
the stable shift, then one all-reduce (sum) of a (tokens, 2) or (tokens, 3) tensor holding the target
logit, the sum of exponentials and, with label smoothing, the sum of logits. The backward is local.

Label smoothing follows `torch.nn.functional.cross_entropy`: with ε = label_smoothing and V =
`vocab_size`, loss = (1-ε)·(−log p_label) + ε·mean_v(−log p_v).
"""
from __future__ import annotations

import torch

from megazero.runtime import comm
from megazero.runtime.comm import GroupHandle


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, vocab_size, smoothing, ignore_index):
        # Memory: ONE fp32 (tokens, Vp/t) buffer, made by the shift, turned into the softmax in place and
        # saved; backward turns it into the gradient in place (plus its copy in the logits' dtype when
        # that is not fp32). The logits themselves are never copied or written.
        per_rank = logits.shape[-1]
        start = group.rank * per_rank
        n_valid = max(0, min(per_rank, vocab_size - start))  # real (unpadded) columns on this rank
        if n_valid > 0:
            gmax = logits[..., :n_valid].amax(dim=-1).float()  # (tokens,): a view's reduction, no copy
        else:
            gmax = torch.full(logits.shape[:-1], float("-inf"), dtype=torch.float32, device=logits.device)
        comm.all_reduce(gmax, group, op="max")
        x = torch.sub(logits, gmax.unsqueeze(-1), out=torch.empty(logits.shape, dtype=torch.float32,
                                                                    device=logits.device))  # fp32 buffer
        x[..., n_valid:] = float("-inf")  # padding columns: probability 0
        ignored = labels == ignore_index
        local = labels - start
        mine = (local >= 0) & (local < n_valid) & ~ignored
        idx = local.clamp(0, per_rank - 1).unsqueeze(-1)
        target = torch.gather(x, -1, idx).squeeze(-1).masked_fill(~mine, 0.0)
        parts = [target]
        if smoothing > 0:
            smooth_sum = x[..., :n_valid].sum(-1)  # before the exponential overwrites x
        softmax = x.exp_()  # in place: (tokens, per_rank), zero on padding
        parts.append(softmax.sum(-1))
        if smoothing > 0:
            parts.append(smooth_sum)
        sums = torch.stack(parts, dim=-1)  # (tokens, 2 or 3)
        comm.all_reduce(sums, group)
        log_z = sums[..., 1].log()
        loss = log_z - sums[..., 0]
        if smoothing > 0:
            mean_logp = sums[..., 2] / vocab_size - log_z
            loss = (1.0 - smoothing) * loss - smoothing * mean_logp
        loss = loss.masked_fill(ignored, 0.0)
        softmax.div_(sums[..., 1].unsqueeze(-1))
        ctx.save_for_backward(softmax, idx, mine, ignored)
        ctx.meta = (n_valid, smoothing, vocab_size, logits.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, mine, ignored = ctx.saved_tensors
        n_valid, smoothing, vocab_size, dtype = ctx.meta
        grad = softmax  # d loss / d logits = softmax - (1-ε)·onehot - ε/V on real columns
        grad.scatter_add_(-1, idx, -(1.0 - smoothing) * mine.unsqueeze(-1).to(grad.dtype))
        if smoothing > 0:
            grad[..., :n_valid] -= smoothing / vocab_size
        grad.mul_((grad_loss.float() * ~ignored).unsqueeze(-1))
        return grad.to(dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, labels: torch.Tensor, tp_group: GroupHandle,
                                 vocab_size: int, label_smoothing: float = 0.0, ignore_index: int = -100,
                                 reduction: str = "none") -> torch.Tensor:
    """Cross-entropy of vocabulary-parallel logits (see the module docstring).

    Args:
        logits_shard: (..., Vp/t) this rank's columns of the padded vocabulary.
        labels: (...) global token ids in [0, vocab_size), or `ignore_index`.
        vocab_size: the real vocabulary size V (columns >= V are padding).
        reduction: ``"none"`` (per-token loss, 0 at ignored positions), ``"sum"``, or ``"mean"``
            (over non-ignored tokens, as torch does).
    """
    if labels.shape != logits_shard.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match logits "
                         f"{tuple(logits_shard.shape)} without the vocab dim")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if logits_shard.shape[-1] * tp_group.size < vocab_size:
        raise ValueError(f"logits cover {logits_shard.shape[-1]}·{tp_group.size} columns, fewer than "
                         f"vocab_size={vocab_size}")
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction {reduction!r} is not one of none, sum, mean")
    loss = _VocabParallelCrossEntropy.apply(logits_shard, labels, tp_group, vocab_size,
                                            float(label_smoothing), ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (labels != ignore_index).sum().clamp(min=1)
