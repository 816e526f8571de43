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


def see_memory_usage(message: str, force: bool = False) -> str | None:
    """DeepSpeed's `deepspeed.runtime.utils.see_memory_usage`: with `force`, rank 0 prints `message`, the
    accelerator's allocated / peak / reserved memory (GB) and the host's used memory, then resets the
    peak for the next call; returns what it printed (None otherwise)."""
    if not force or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        return None
    import gc
    import os

    from megazero.compat.accelerator import get_accelerator

    gc.collect()
    acc, gb = get_accelerator(), 1024 ** 3
    page = os.sysconf("SC_PAGE_SIZE")
    total, free = os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
    text = (f"{message}\nMA {acc.memory_allocated() / gb:.2f} GB         Max_MA {acc.max_memory_allocated() / gb:.2f} GB"
            f"         CA {acc.memory_reserved() / gb:.2f} GB         Max_CA {acc.max_memory_reserved() / gb:.0f} GB \n"
            f"CPU Virtual Memory:  used = {(total - free) / gb:.2f} GB, percent = {100 * (total - free) / total:.1f}%")
    print(text, flush=True)
    acc.reset_peak_memory_stats()
    return text
