"""Context parallelism: the tokens of each sequence split over the cp group (`token_layout`), attention over the
whole sequence by ring attention (`ring`: key/value blocks passed around the group, overlapped with the block
computations) or Ulysses (`ulysses`: all-to-alls that trade the sequence split for a head split)."""
from megazero.context_parallel.token_layout import positions, take
from megazero.context_parallel.ring import ring_attention
from megazero.context_parallel.ulysses import ulysses_attention

__all__ = ["positions", "take", "ring_attention", "ulysses_attention"]
