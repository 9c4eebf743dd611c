"""The `aio` section: DeepSpeed's NVMe I/O settings, mapped onto tiering's `AioConfig`.

A key left out keeps tiering's default (measured on our disks, see tiering/aio_config.py), not DeepSpeed's;
a key written down is honoured. The ranges are tiering's rules: `to_aio_config` builds tiering's dataclass
and its TieringConfigError is what a bad value raises (the loader renames it to the JSON key)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from tiering.aio_config import AioConfig

from .schema import Section, Unsupported, setting


@dataclass(frozen=True, kw_only=True)
class AioSection(Section):
    """DeepSpeed's `aio`. null: tiering's default for that setting."""

    block_size: int | None = None
    """Bytes per I/O request (a multiple of 4096)."""

    queue_depth: int | None = None
    """libaio: requests in flight."""

    intra_op_parallelism: int | None = setting(None, aliases=("thread_count",))
    """threads engine: worker threads (DeepSpeed's old name: thread_count)."""

    single_submit: bool | None = None
    """libaio: one io_submit per request instead of one per batch."""

    overlap_events: bool | None = None
    """libaio: refill the queue as each completion arrives."""

    UNSUPPORTED = {
        "use_gds": Unsupported("GPUDirect Storage; nvme bytes go through pinned host buffers", off=False),
    }

    def to_aio_config(self, engine: Literal["auto", "libaio", "threads"]) -> AioConfig:
        """tiering's AioConfig with the settings written here and `engine` (from the zero_tiering section).
        Raises tiering's TieringConfigError for a value tiering refuses."""
        given = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        return AioConfig(engine=engine, **given)
