"""Settings of the swap manager; DeepSpeed's stage3 prefetch keys map onto the prefetch fields."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import TieringConfigError
from .nvme_store import NvmeStoreConfig

MiB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class SwapConfig:
    host_budget: int
    """Hard cap in bytes on host copies of segments (pinned buffers when CUDA is present)."""

    device_budget: int | None = None
    """Hard cap in bytes on device copies; None: unlimited. Without CUDA the device tier is host memory
    counted against this budget."""

    nvme: NvmeStoreConfig | None = None
    """Where nvme-homed segments live; None: no nvme tier (registering one with home 'nvme' raises)."""

    prefetch_bytes: int = 256 * MiB
    """Bytes that prefetch may bring ahead of use and hold unused (DeepSpeed: stage3_prefetch_bucket_size)."""

    max_live_bytes: int | None = None
    """Prefetch never raises the device tier's bytes in use above this (DeepSpeed:
    stage3_max_live_parameters); None: only the device budget limits it."""

    reuse_distance: int | None = None
    """A released segment's device copy whose next use (per the trace) is more than this many bytes of other
    fetches away is dropped to the tier below right away, so its room is free before anyone waits for it
    (DeepSpeed: stage3_max_reuse_distance, which frees a gathered parameter's accelerator memory). Host copies
    are evicted only under pressure. None: device copies too."""

    checksums: bool = True
    """Record an xxh3-64 checksum when a segment is written to nvme and verify it on every read."""

    pin: bool | None = None
    """Page-lock host buffers; None: when CUDA is available."""

    timeline: bool = True
    """Record every move and marked compute span (for `write_chrome_trace`)."""

    def __post_init__(self) -> None:
        for name in ("host_budget", "device_budget", "prefetch_bytes", "max_live_bytes", "reuse_distance"):
            value = getattr(self, name)
            optional = name not in ("host_budget", "prefetch_bytes")
            if (value is None and not optional) or (value is not None and (not isinstance(value, int) or value < 0)):
                raise TieringConfigError(name, value, "a non-negative integer of bytes" + (" or None" if optional else ""))
