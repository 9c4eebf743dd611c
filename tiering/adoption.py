"""Adoption: a device tensor the caller made becomes a segment without a copy (a part of SwapManager, cut out as
one concept). What autograd saves in the forward is the use: it already exists on the device, so registering it
(a copy into a fresh buffer) would cost the compute stream a copy and the device twice the bytes; adopted, it is
counted where it is and leaves on the copy stream.
"""
from __future__ import annotations

import torch

from .errors import TieringConfigError, TieringError
from .eviction import Kind
from .handle import Handle, completed
from .residency import TIER_ORDER, Residency, Tier
from .segment import Segment


class Adoption:
    def adopt(self, name: str, tensor: torch.Tensor, *, home: Tier) -> Handle:
        """Add a segment whose bytes are `tensor`, a contiguous tensor on the device made by the caller, who
        writes it no more: no copy is made here. It counts against the device budget from now on and is moved
        toward `home` at once ("host" or "nvme": device->host on the copy stream, behind the compute queued so far,
        then like any host copy; "device": it stays). The handle is done when its bytes have left the device."""
        if home not in TIER_ORDER:
            raise TieringConfigError("home", home, "one of 'device', 'host', 'nvme'")
        if home == "nvme" and self.store is None:
            raise TieringError(f"segment {name!r} has home 'nvme' but the swap manager has no nvme store")
        if not tensor.is_contiguous() or tensor.device != self.device_tier.device:
            raise ValueError(f"adopt {name!r}: a contiguous tensor on {self.device_tier.device} is needed, "
                             f"got {'a strided' if not tensor.is_contiguous() else 'a'} tensor on {tensor.device}")
        seg = Segment(name, tensor.dtype, tensor.shape, home, Residency.DEVICE)
        with self._lock:
            if name in self.segments:
                raise ValueError(f"segment {name!r} is already registered")
            self._fit("device", seg, blocking=True, wait=True)
            if name in self.segments:  # registered by another thread while room was made (the lock let go)
                raise ValueError(f"segment {name!r} is already registered")
            seg.device = self.device_tier.adopt(tensor.reshape(-1).view(torch.uint8), name)
            self.segments[name] = seg
            self._note_peaks()
        if home == "device":
            return completed(name)
        while True:  # the first step home: device->host, once the host has room
            with self._lock:
                if seg.state.moving:  # another thread's room-making started its way home: that move is the one
                    return seg.move
                step = self._evict_step(seg, blocking=True)
                if step.kind is not Kind.WAIT:
                    return step.handle if step.kind is Kind.STARTED else completed(name)
            step.handle.wait()
