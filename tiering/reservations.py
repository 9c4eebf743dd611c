"""Reservations: memory a caller allocates itself, counted against a tier's budget (a part of SwapManager, cut out
as one concept): a gathered unit's full buffer or a unit's gradients on the device, a staging buffer on the host.
Room is made for them as for a segment brought up, by eviction."""
from __future__ import annotations

import torch

from .host_pool import HostBuffer, made
from .residency import Residency
from .segment import Segment


class Reservations:
    def reserve_device(self, nbytes: int, what: str, part: str) -> None:
        """Count `nbytes` of device memory the caller allocates itself (`part`: a gathered unit's full buffer,
        the backward's gradients of a unit, the reduction's scratch) against the device budget, evicting segments
        to make room first; undo with `unreserve_device`. Counted as the tier charges a buffer of that size (whole
        pages without CUDA), as the room made for it was."""
        nbytes = self.device_tier.charge(nbytes)
        stand_in = Segment(what, torch.uint8, (nbytes,), "device", Residency.DEVICE)  # sized like the buffer
        with self._lock:
            self._fit("device", stand_in, blocking=True, wait=True)
            self.device_tier.reserve(nbytes, what, part)
            self._note_peaks()

    def unreserve_device(self, nbytes: int, part: str) -> None:
        with self._lock:
            self.device_tier.unreserve(self.device_tier.charge(nbytes), part)

    def acquire_host(self, nbytes: int, what: str) -> HostBuffer:
        """A host buffer of `nbytes` from the pool for the caller's own use (a staging buffer), evicting segments
        to make room first, as a segment brought to the host would; give it back with its `release()`."""
        stand_in = Segment(what, torch.uint8, (nbytes,), "host", Residency.HOST)  # sized like the buffer
        with self._lock:
            self._fit("host", stand_in, blocking=True, wait=True)
            buffer = self.pool.acquire(nbytes, what, unmade=True)
            self._note_peaks()
        return made(buffer)  # off the lock
