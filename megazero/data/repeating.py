"""`RepeatingLoader`: DeepSpeed's endless wrapper of a DataLoader (a new epoch when one ends)."""
from __future__ import annotations


class RepeatingLoader:
    """Iterate `loader` forever: when an epoch ends, start it again (a DistributedSampler gets
    `set_epoch`, so a shuffled one draws a new order each epoch, as torch documents)."""

    def __init__(self, loader):
        self.loader, self.epoch = loader, 0
        self._it = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._it)
        except StopIteration:
            self.epoch += 1
            sampler = getattr(self.loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            self._it = iter(self.loader)
            return next(self._it)
