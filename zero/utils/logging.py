"""DeepSpeed's `deepspeed.utils.logging`: the `logger` scripts log through (transformers sets its level from the
Trainer's arguments) and `log_dist`, which logs a message on the ranks named."""
from __future__ import annotations

import logging

import torch.distributed as dist

logger = logging.getLogger("zero")
"""zero-tiering's logger. It has no handler of its own, as a library's should: the application's logging setup
decides where records go (unconfigured, warnings and errors reach stderr; DeepSpeed's shows the same levels)."""


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` prefixed `[Rank r]` where no process group exists, or where this rank is in `ranks` (`[-1]`:
    every rank), as DeepSpeed's does."""
    joined = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if joined else -1
    if not joined or (ranks and (ranks[0] == -1 or rank in ranks)):
        logger.log(level, f"[Rank {rank}] {message}")
