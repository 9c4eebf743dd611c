"""Settings of the NVMe I/O engines, named after DeepSpeed's `aio` section where a setting carries over."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import TieringConfigError

MiB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class AioConfig:
    engine: Literal["auto", "libaio", "threads"] = "auto"
    """`libaio`: Linux kernel AIO with O_DIRECT. `threads`: os.preadv/pwritev from a thread pool, O_DIRECT
    where the filesystem allows it. `auto`: libaio where the system library loads and O_DIRECT works on the
    path, else threads; the store reports which it chose and why."""

    block_size: int = 8 * MiB
    """Bytes per I/O request; a transfer is cut into blocks of this size. Multiple of 4 KiB. 8 MiB reached
    the disk's limit here (bench/RESULTS.md); DeepSpeed's default is 1 MiB."""

    queue_depth: int = 8
    """libaio: requests in flight at once. threads: ignored (in flight = intra_op_parallelism). With 8 MiB
    blocks, 8 in flight already reach the disk's limit here, and a shallower queue finishes segments closer
    to the order they were asked for (prefetch wants the next segment first, not all of them at once)."""

    intra_op_parallelism: int = 4
    """threads: worker threads, hence requests in flight. libaio: ignored (one submitter, one reaper)."""

    single_submit: bool = False
    """libaio: one io_submit call per request instead of one per batch. threads: ignored."""

    overlap_events: bool = True
    """libaio: refill the queue as each completion arrives; False waits for a whole batch of queue_depth
    completions before submitting more. threads: ignored."""

    def __post_init__(self) -> None:
        if self.engine not in ("auto", "libaio", "threads"):
            raise TieringConfigError("aio.engine", self.engine, "one of 'auto', 'libaio', 'threads'")
        if not isinstance(self.block_size, int) or self.block_size <= 0 or self.block_size % 4096:
            raise TieringConfigError("aio.block_size", self.block_size, "a positive multiple of 4096")
        for name in ("queue_depth", "intra_op_parallelism"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= 1024:
                raise TieringConfigError(f"aio.{name}", value, "an integer in 1..1024")
        for name in ("single_submit", "overlap_events"):
            if not isinstance(getattr(self, name), bool):
                raise TieringConfigError(f"aio.{name}", getattr(self, name), "true or false")
