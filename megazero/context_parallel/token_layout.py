"""Which tokens of a sequence each rank of a context-parallel group holds. Pure arithmetic, no communication.

Causal attention does more work for late tokens than for early ones, so a rank holding one contiguous s/cp
slice would leave the first ranks idle. As in Megatron-Core and torchtitan, the sequence is cut into 2·cp
chunks of s/(2·cp) tokens and cp rank r holds chunks r and 2·cp−1−r (a head and a tail chunk), concatenated:

    s = 16, cp = 2:  chunks [0-3] [4-7] [8-11] [12-15];  rank 0 holds 0-3 + 12-15, rank 1 holds 4-7 + 8-11

Every rank then computes the same number of attention scores. `positions(s, r, cp)` lists rank r's token
positions in the order it holds them; `take(t, dim, r, cp)` selects them from a full-sequence tensor (the data
loader's tokens and labels, the packed documents' ids); `gathered_order(s, cp)` is the order of a sequence
gathered rank by rank (Ulysses' all-to-all), and `natural_order` the permutation that undoes it.
"""
from __future__ import annotations

import torch


def check_divisible(seq: int, cp: int) -> None:
    """Raise unless a sequence of `seq` tokens splits into 2·cp equal chunks."""
    if cp > 1 and seq % (2 * cp):
        raise ValueError(f"model.seq_len={seq}: context parallelism over parallel.cp={cp} ranks cuts the sequence "
                         f"into 2*cp={2 * cp} equal chunks (a head and a tail chunk per rank); use a multiple of "
                         f"{2 * cp}")


def chunks_of(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2·cp) cp rank `rank` holds, in the order it holds them."""
    return rank, 2 * cp - 1 - rank


def positions(seq: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """cp rank `rank`'s token positions (LongTensor of seq/cp) in the order it holds them."""
    if cp == 1:
        return torch.arange(seq, device=device)
    check_divisible(seq, cp)
    c = seq // (2 * cp)
    return torch.cat([torch.arange(k * c, (k + 1) * c, device=device) for k in chunks_of(rank, cp)])


def take(t: torch.Tensor, dim: int, rank: int, cp: int) -> torch.Tensor:
    """This rank's tokens of `t` along `dim` (a full sequence there): its head chunk, then its tail chunk."""
    if cp == 1:
        return t
    seq = t.shape[dim]
    check_divisible(seq, cp)
    parts = t.chunk(2 * cp, dim=dim)  # 2·cp views of seq/(2·cp) tokens
    return torch.cat([parts[k] for k in chunks_of(rank, cp)], dim=dim)


def gathered_order(seq: int, cp: int) -> torch.Tensor:
    """The positions of a sequence gathered rank by rank (rank 0's tokens, then rank 1's, ...)."""
    return torch.cat([positions(seq, r, cp) for r in range(cp)])


def natural_order(seq: int, cp: int) -> torch.Tensor:
    """The permutation p with gathered[p] in position order: index a gathered sequence with it to sort it."""
    return torch.argsort(gathered_order(seq, cp))
