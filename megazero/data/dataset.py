"""Fixed-length training samples over a token stream, and their deterministic (shuffled) order.

The stream is the token file's documents back to back (each ends with the end-of-document token
when the data was preprocessed with --append-eod, the default). Sample i is the seq_len + 1 tokens
starting at i * seq_len; consecutive samples share one token, so every token except the first is
a label exactly once per epoch:

    input_ids = stream[i*seq_len : (i+1)*seq_len]
    labels    = stream[i*seq_len + 1 : (i+1)*seq_len + 1]

The tail that does not fill a whole sample is dropped. Pure (no process groups).

Packed documents (``documents=True``, config ``data.packed_documents``): a sample also carries ``doc_ids``,
the document of each input position (0 for the sample's first document, counting up; from the source's
document offsets, so no end-of-document token is needed), and the label of the last position of each
document but the sample's last, which would be the next document's first token, is ignored (-100): a
model attending within documents (`megazero.models.packed`) cannot predict it.

    doc_ids[j] = (document of token i*seq_len + j) - (document of token i*seq_len)
    labels[j]  = -100 where doc_ids[j] differs from the document of token i*seq_len + j + 1
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch


class TokenSource(Protocol):
    """What a dataset reads: `IndexedTokens` or `InMemoryTokens`."""

    prefix: str
    num_tokens: int
    vocab_size: int
    doc_offsets: torch.Tensor  # (num_docs + 1,) token offsets: document d is tokens [doc_offsets[d], doc_offsets[d + 1])

    def tokens(self, start: int, length: int) -> torch.Tensor: ...


class TokenSampleDataset:
    """Samples of `seq_len` input tokens (and `seq_len` shifted labels) over `source`'s stream.

    ``len(ds) == (num_tokens - 1) // seq_len``; ``ds[i]`` is
    ``{"input_ids": LongTensor(seq_len), "labels": LongTensor(seq_len)}``, with `documents` also
    ``"doc_ids": LongTensor(seq_len)`` and the cross-document labels ignored (module docstring).
    """

    def __init__(self, source: TokenSource, seq_len: int, documents: bool = False):
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r} must be a positive integer")
        if source.num_tokens < seq_len + 1:
            raise ValueError(f"seq_len={seq_len} needs at least {seq_len + 1} tokens per sample but the "
                             f"data {source.prefix!r} has only {source.num_tokens} tokens: lower seq_len "
                             "or preprocess more text (a larger --max-bytes or more --input files)")
        self.source = source
        self.seq_len = seq_len
        self.num_samples = (source.num_tokens - 1) // seq_len
        self.documents = documents

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} outside [0, {self.num_samples})")
        i %= self.num_samples
        window = self.source.tokens(i * self.seq_len, self.seq_len + 1)  # (seq_len + 1,)
        sample = {"input_ids": window[:-1], "labels": window[1:]}
        if self.documents:
            where = torch.arange(i * self.seq_len, (i + 1) * self.seq_len + 1)  # the window's stream positions
            doc = torch.searchsorted(self.source.doc_offsets, where, right=True) - 1  # (seq_len + 1,)
            sample["doc_ids"] = doc[:-1] - doc[0]
            sample["labels"] = sample["labels"].masked_fill(doc[1:] != doc[:-1], -100)
        return sample


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """A permutation of range(num_samples) determined by (seed, epoch) alone (LongTensor)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed((int(seed) * 1_000_003 + int(epoch) * 7919 + 17) % (2**63 - 1))
    return torch.randperm(num_samples, generator=gen)


class SampleOrder:
    """Maps a global sample position (0, 1, 2, ... over all epochs) to a dataset index.

    Position p is in epoch p // num_samples; inside an epoch the order is
    `epoch_permutation(num_samples, seed, epoch)`, or the natural order when `shuffle` is False.
    Keeps the permutation of the epoch last asked for (a global batch straddles at most two).
    """

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True):
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples} must be >= 1")
        self.num_samples, self.seed, self.shuffle = num_samples, int(seed), shuffle
        self._cached: dict[int, torch.Tensor] = {}

    def permutation(self, epoch: int) -> Optional[torch.Tensor]:
        """The order of `epoch` (None = natural order)."""
        if not self.shuffle:
            return None
        if epoch not in self._cached:
            if len(self._cached) >= 2:
                self._cached.pop(min(self._cached))
            self._cached[epoch] = epoch_permutation(self.num_samples, self.seed, epoch)
        return self._cached[epoch]

    def index(self, position: int) -> int:
        """The dataset index of global sample `position` (>= 0)."""
        if position < 0:
            raise IndexError(f"sample position {position} must be >= 0")
        epoch, within = divmod(position, self.num_samples)
        perm = self.permutation(epoch)
        return within if perm is None else int(perm[within])
