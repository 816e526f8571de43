"""DeepSpeed's small helpers: the logger and `log_dist` (`deepspeed.utils`). Local: no communication."""
from __future__ import annotations

import logging

import torch.distributed as dist

logger = logging.getLogger("megazero")  # DeepSpeed's is named "DeepSpeed"; configure it as any logging.Logger


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else -1


def _should_log(ranks) -> bool:
    """DeepSpeed's rule: every rank before torch.distributed is up; otherwise the ranks listed, all
    of them with -1 in the list; rank 0 when `ranks` is None."""
    rank = _rank()
    if rank < 0:
        return True
    ranks = [0] if ranks is None else list(ranks)
    return -1 in ranks or rank in ranks


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """Log `message` on the given ranks (default rank 0), prefixed with the rank, as DeepSpeed's."""
    if _should_log(ranks):
        logger.log(level, f"[Rank {_rank()}] {message}")


def print_dist(message: str, ranks=None) -> None:
    """`log_dist`'s rule, printed whatever the log level."""
    if _should_log(ranks):
        print(f"[Rank {_rank()}] {message}", flush=True)


def set_log_level_from_string(level: str, custom_logger=None) -> None:
    """Set a logger's level from its name ("debug", "INFO", ...)."""
    value = getattr(logging, str(level).upper(), None)
    if not isinstance(value, int):
        raise ValueError(f"log level {level!r}: use one of debug, info, warning, error, critical")
    (custom_logger or logger).setLevel(value)
