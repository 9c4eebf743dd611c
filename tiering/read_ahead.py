"""Read-ahead: moves started before anyone asks, from a caller's `prefetch` list and along the recorded trace (a
part of SwapManager, cut out as one concept). A prefetched copy is not pinned; `_prefetched_bytes` counts them
against `prefetch_bytes` until they are used or dropped."""
from __future__ import annotations

from typing import Iterable

from .handle import Handle, gather
from .residency import Tier
from .segment import Segment


class ReadAhead:
    def prefetch(self, names: Iterable[str], tier: Tier = "device") -> Handle:
        """Start bringing segments to `tier` without pinning them, in order, as far as room allows without
        waiting (never evicting a segment needed sooner than the one prefetched); the rest are started as room
        frees, until the next `prefetch` call says anew what lies ahead. The handle covers the moves begun."""
        with self._lock:
            segments = [self._get(name) for name in names]
            for seg in segments:  # all checked before any move starts, whether or not room runs out first
                self._check_target(seg, tier)
            self._read_ahead = [(seg, tier) for seg in segments]
            return gather(self._start_read_ahead(), "prefetch")

    def _start_read_ahead(self) -> list[Handle]:
        """With the lock held: start the moves of `_read_ahead` in order until one finds no room; drop those
        started or no longer needing a move."""
        handles = []
        while self._read_ahead and not self._closing:
            seg, tier = self._read_ahead[0]
            if not (seg.state.moving or seg.state.tier == tier or seg.pins or seg.spent):
                handle = self._start_prefetch(seg, tier)
                if handle is None:
                    break
                handles.append(handle)
            self._read_ahead.pop(0)
        return handles

    def _prefetch_ahead(self) -> None:
        """Start the read-ahead a `prefetch` call left waiting for room, then moves for the uses the trace says
        come next, within the prefetch and live-byte budgets."""
        with self._lock:
            self._start_read_ahead()
            live_cap = self.config.max_live_bytes
            for name, tier in [] if self._closing else self.trace.upcoming():
                seg = self.segments.get(name)
                if (seg is None or seg.pins or seg.spent or seg.state.moving or seg.state.tier == tier or seg.prefetched
                        or seg.overwrite_expected):
                    continue
                if self._prefetched_bytes + seg.nbytes > self.config.prefetch_bytes:
                    break
                live = self.device_tier.in_use + self.device_tier.charge(seg.nbytes)
                if tier == "device" and live_cap is not None and live > live_cap:
                    break
                if self._start_prefetch(seg, tier) is None:
                    break

    def _start_prefetch(self, seg: Segment, tier: Tier) -> Handle | None:
        """With the lock held: start an unpinned move of `seg` to `tier` and count it; None where no room frees
        without waiting."""
        handle = self._bring(seg, tier, pin=False, blocking=False)
        if handle is not None:
            seg.prefetched = True
            self._prefetched_bytes += seg.nbytes
            self.stats.prefetches += 1
        return handle

    def _unprefetch(self, seg: Segment) -> None:
        if seg.prefetched:
            seg.prefetched = False
            self._prefetched_bytes -= seg.nbytes
