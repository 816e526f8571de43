"""Micro-batches sharded by dp rank: deterministic, resumable from any step, no communication.

With B = micro_batch_size * gradient_accumulation_steps * dp_size (the global batch), optimizer
step k consumes global sample positions [k*B, (k+1)*B) of the (shuffled) order (see
`dataset.SampleOrder`; positions past the end of an epoch wrap into the next epoch, which has its
own permutation). Inside that global batch dp rank r owns the r-th contiguous slice of
micro_batch_size * gradient_accumulation_steps positions, and cuts it into its micro-batches in
order:

    micro-batch j of step k on dp rank r = positions k*B + (r*gas + j)*m + [0, m)

(m = micro_batch_size, gas = gradient_accumulation_steps). Every tp rank and pipeline stage of
one dp replica computes the same slice independently, so the ranks that load data agree without
talking. Resuming at step k computes positions from k directly: skipped data is never read.

With ``num_workers`` > 0 (config ``data.num_workers``) worker processes read the micro-batches ahead
(`WorkerMicroBatches`, a torch DataLoader over the same random-access `MicroBatchIterator.micro_batch`): the
same micro-batches in the same order, whatever the number of workers.
"""
from __future__ import annotations

import itertools
from typing import Optional

import torch
import torch.utils.data

from .dataset import SampleOrder, TokenSampleDataset
from .indexed import IndexedTokens
from .tokenizer import check_vocab


class MicroBatchIterator:
    """Yields this dp rank's micro-batches, step after step, forever (epochs wrap).

    Each item is ``{"input_ids": LongTensor(m, seq_len), "labels": LongTensor(m, seq_len)}``;
    ``gradient_accumulation_steps`` consecutive items make up one optimizer step. `step` and `micro`
    tell which micro-batch comes next; `state_dict()` records them for checkpoints.
    """

    def __init__(self, dataset: TokenSampleDataset, micro_batch_size: int, gradient_accumulation_steps: int,
                 dp_rank: int, dp_size: int, seed: int, start_step: int = 0, shuffle: bool = True):
        _check_layout(micro_batch_size, gradient_accumulation_steps, dp_rank, dp_size, start_step)
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = int(seed), shuffle
        self.order = SampleOrder(len(dataset), seed, shuffle)
        self.step, self.micro = start_step, 0

    @property
    def global_batch_size(self) -> int:
        """Samples consumed by all dp ranks in one optimizer step (m * gas * dp)."""
        return self.micro_batch_size * self.gradient_accumulation_steps * self.dp_size

    def positions(self, step: int, mb: int) -> range:
        """Global sample positions of micro-batch `mb` of `step` on this dp rank."""
        if not 0 <= mb < self.gradient_accumulation_steps:
            raise IndexError(f"micro-batch {mb} outside [0, gradient_accumulation_steps="
                             f"{self.gradient_accumulation_steps})")
        m = self.micro_batch_size
        start = step * self.global_batch_size + (self.dp_rank * self.gradient_accumulation_steps + mb) * m
        return range(start, start + m)

    def micro_batch(self, step: int, mb: int) -> dict[str, torch.Tensor]:
        """Micro-batch `mb` of optimizer step `step` for this dp rank (random access, no state change)."""
        samples = [self.dataset[self.order.index(p)] for p in self.positions(step, mb)]
        return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}  # (m, seq) each

    def __iter__(self) -> "MicroBatchIterator":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = self.micro_batch(self.step, self.micro)
        self.micro += 1
        if self.micro == self.gradient_accumulation_steps:
            self.step, self.micro = self.step + 1, 0
        return batch

    def state_dict(self) -> dict[str, int]:
        """Where this iterator is; rebuild with ``start_step=state["step"]`` (micro is 0 between steps)."""
        return {"step": self.step, "micro": self.micro, "seed": self.seed,
                "global_batch_size": self.global_batch_size}

    def __repr__(self) -> str:
        return (f"MicroBatchIterator(samples={len(self.dataset)}, seq_len={self.dataset.seq_len}, "
                f"m={self.micro_batch_size}, gas={self.gradient_accumulation_steps}, "
                f"dp={self.dp_rank}/{self.dp_size}, step={self.step}, micro={self.micro})")


class _MicroBatchSequence(torch.utils.data.Dataset):
    """Item k: the k-th micro-batch of `it` from its current position (step it.step, micro-batch it.micro)."""

    def __init__(self, it: MicroBatchIterator):
        self.it, self.first = it, it.step * it.gradient_accumulation_steps + it.micro

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        step, mb = divmod(self.first + k, self.it.gradient_accumulation_steps)
        return self.it.micro_batch(step, mb)


class _Endless(torch.utils.data.Sampler):
    """0, 1, 2, ... forever (the micro-batch sequence has no end: epochs wrap)."""

    def __iter__(self):
        return itertools.count()


class WorkerMicroBatches:
    """`it`'s micro-batches, in its order, read ahead by `num_workers` worker processes (a torch DataLoader,
    ``batch_size=None``: each item is already a micro-batch); `step`, `micro` and `state_dict()` say what
    the caller has taken, as `MicroBatchIterator`'s do."""

    def __init__(self, it: MicroBatchIterator, num_workers: int):
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers={num_workers!r} must be an integer >= 1 (0: read in this process)")
        self.source, self.num_workers = it, num_workers
        self.step, self.micro = it.step, it.micro
        loader = torch.utils.data.DataLoader(_MicroBatchSequence(it), batch_size=None, sampler=_Endless(),
                                             num_workers=num_workers)
        self._batches = iter(loader)

    def __iter__(self) -> "WorkerMicroBatches":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = next(self._batches)
        self.micro += 1
        if self.micro == self.source.gradient_accumulation_steps:
            self.step, self.micro = self.step + 1, 0
        return batch

    def state_dict(self) -> dict[str, int]:
        """Where the caller is (as `MicroBatchIterator.state_dict`; the workers may have read further)."""
        return {"step": self.step, "micro": self.micro, "seed": self.source.seed,
                "global_batch_size": self.source.global_batch_size}


class NoDataIterator:
    """Stands in for the data iterator on pipeline stages that read no data (middle stages).

    It never touches the data files; asking it for a batch is a bug in the caller and raises.
    """

    def __init__(self, path_prefix: str, start_step: int = 0):
        self.path_prefix = path_prefix
        self.step, self.micro = start_step, 0

    def __iter__(self) -> "NoDataIterator":
        return self

    def __next__(self):
        raise RuntimeError(f"this pipeline stage was built with needs_data=False and does not read "
                           f"{self.path_prefix!r}; only the first stage (input_ids) and the last stage "
                           "(labels) may ask the data iterator for micro-batches")

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "micro": self.micro}


def build_data_iterator(path_prefix: str, seq_len: int, micro_batch_size: int,
                        gradient_accumulation_steps: int, dp_rank: int, dp_size: int, seed: int,
                        start_step: int = 0, needs_data: bool = True, shuffle: bool = True,
                        model_vocab: Optional[int] = None, documents: bool = False, num_workers: int = 0):
    """This rank's micro-batch iterator over ``<path_prefix>.bin/.idx``.

    Returns a `MicroBatchIterator` (see the module docstring for which samples a dp rank gets), the same
    micro-batches read ahead by `num_workers` processes (`WorkerMicroBatches`) when it is > 0, or
    a `NoDataIterator` when `needs_data` is False: then the data files are not opened or even
    checked for existence. Arguments are validated on every rank alike. With `model_vocab` the
    data's vocab is checked against the model's (`check_vocab`). With `documents` each micro-batch carries
    its documents (`TokenSampleDataset`: ``doc_ids``, cross-document labels ignored).

    Raises DataPathError (one line naming the path and the preprocess command) if the files do not
    exist, ValueError if the corpus is shorter than one sample or the vocab does not fit.
    """
    _check_layout(micro_batch_size, gradient_accumulation_steps, dp_rank, dp_size, start_step)
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} must be a positive integer")
    if not needs_data:
        return NoDataIterator(path_prefix, start_step)
    source = IndexedTokens(path_prefix)
    if model_vocab is not None:
        check_vocab(source.vocab_size, model_vocab, source.tokenizer_name)
    dataset = TokenSampleDataset(source, seq_len, documents=documents)
    it = MicroBatchIterator(dataset, micro_batch_size, gradient_accumulation_steps, dp_rank, dp_size,
                            seed, start_step=start_step, shuffle=shuffle)
    return WorkerMicroBatches(it, num_workers) if num_workers else it


def _check_layout(micro_batch_size: int, gradient_accumulation_steps: int, dp_rank: int, dp_size: int,
                  start_step: int) -> None:
    for name, value, low in (("micro_batch_size", micro_batch_size, 1),
                             ("gradient_accumulation_steps", gradient_accumulation_steps, 1),
                             ("dp_size", dp_size, 1), ("start_step", start_step, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank!r} must be an integer in [0, dp_size={dp_size})")
