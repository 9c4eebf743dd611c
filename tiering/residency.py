"""Residency: which tier holds a segment's authoritative bytes, and whether a move is in flight.

One enum and one table of legal transitions. A segment's residency names its top copy (the current bytes);
copies in lower tiers may be current too (then dropping the top copy is free) or stale (then it must be
written back first). Every change goes through `Residency.after(action)`, which raises on an illegal one.
"""
from __future__ import annotations

from enum import Enum
from typing import Literal

from .errors import IllegalTransitionError

Tier = Literal["device", "host", "nvme"]
TIER_ORDER: dict[str, int] = {"nvme": 0, "host": 1, "device": 2}


class Residency(Enum):
    NVME = "on nvme"
    READING = "nvme->host in flight"
    HOST = "on host"
    TO_DEVICE = "host->device in flight"
    DEVICE = "on device"
    TO_HOST = "device->host in flight"
    WRITING = "host->nvme in flight"
    CLEANING = "host->nvme in flight, the host copy kept"

    @property
    def tier(self) -> Tier | None:
        """The tier holding the current bytes, or None while a move is in flight."""
        return _SETTLED.get(self)

    @property
    def moving(self) -> bool:
        return self not in _SETTLED

    def after(self, action: str, what: str) -> Residency:
        """The state `action` leads to from this one; IllegalTransitionError if the table has no such edge."""
        sources, target = TRANSITIONS[action]
        if self not in sources:
            expected = " or ".join(s.name for s in sources)
            raise IllegalTransitionError(what, action, expected, self.name)
        return target


_SETTLED: dict[Residency, Tier] = {
    Residency.NVME: "nvme",
    Residency.HOST: "host",
    Residency.DEVICE: "device",
}

R = Residency
TRANSITIONS: dict[str, tuple[frozenset[Residency], Residency]] = {
    "read": (frozenset({R.NVME}), R.READING),
    "read_done": (frozenset({R.READING}), R.HOST),
    "read_failed": (frozenset({R.READING}), R.NVME),
    "to_device": (frozenset({R.HOST}), R.TO_DEVICE),
    "to_device_done": (frozenset({R.TO_DEVICE}), R.DEVICE),
    "to_device_failed": (frozenset({R.TO_DEVICE}), R.HOST),
    "to_host": (frozenset({R.DEVICE}), R.TO_HOST),
    "to_host_done": (frozenset({R.TO_HOST}), R.HOST),
    "to_host_failed": (frozenset({R.TO_HOST}), R.DEVICE),
    "drop_device_to_host": (frozenset({R.DEVICE}), R.HOST),
    "drop_device_to_nvme": (frozenset({R.DEVICE}), R.NVME),
    "write": (frozenset({R.HOST}), R.WRITING),
    "write_done": (frozenset({R.WRITING}), R.NVME),
    "write_failed": (frozenset({R.WRITING}), R.HOST),
    "drop_host": (frozenset({R.HOST}), R.NVME),
    # Write-behind: a dirty host copy written out early and kept, so evicting it later drops it at once.
    "clean": (frozenset({R.HOST}), R.CLEANING),
    "clean_done": (frozenset({R.CLEANING}), R.HOST),
    "clean_failed": (frozenset({R.CLEANING}), R.HOST),
    # A spent segment is fetched by allocating its buffer: nothing to read or copy.
    "claim_host": (frozenset({R.NVME}), R.HOST),
    "claim_device": (frozenset({R.HOST}), R.DEVICE),
    "claim_device_from_nvme": (frozenset({R.NVME}), R.DEVICE),
}
del R
