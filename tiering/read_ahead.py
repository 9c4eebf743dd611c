"""Read-ahead: moves started before anyone asks, from a caller's `prefetch` list and along the recorded trace (a
part of SwapManager, cut out as one concept). A prefetched copy is not pinned; `_prefetched_bytes` counts them
against `prefetch_bytes` until they are used or dropped.

Two windows along the trace: the prefetch window brings uses all the way to their tier within `prefetch_bytes`
(DeepSpeed's prefetch bucket: on a GPU, device memory held by what is not yet used); past it, frozen segments (only
read by steps: frozen weights, inference's) go on from nvme into host memory (`_stage`), within half the host budget
and never taking room a fetch at the time of use would keep, so that the disk works while the compute runs from
copies the host already holds (a LoRA block cached between its forward and its backward, the next one still on
nvme). The prefetch window takes a staged copy the rest of the way when it gets there. Segments a step rewrites
(trained shards, optimizer state) are not staged: staging them read 5-15% more bytes a step at 1b x 4
(bench/RESULTS.md, session 31)."""
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
        come next: within the prefetch and live-byte budgets all the way, then (`_stage`) into host memory."""
        with self._lock:
            self._start_read_ahead()
            live_cap = self.config.max_live_bytes
            window = True  # still inside the prefetch window
            for name, tier in [] if self._closing else self.trace.upcoming():
                seg = self.segments.get(name)
                if (seg is None or seg.pins or seg.spent or seg.state.moving or seg.state.tier == tier
                        or (seg.prefetched and not seg.staged) or seg.overwrite_expected):
                    continue
                if window:
                    live = self.device_tier.in_use + self.device_tier.charge(seg.nbytes)
                    window = (self._prefetched_bytes + seg.nbytes <= self.config.prefetch_bytes
                              and not (tier == "device" and live_cap is not None and live > live_cap))
                    if window:
                        if self._start_prefetch(seg, tier) is None:  # (staged: now the window's)
                            break
                        continue
                if seg.frozen and not self._stage(seg):
                    break

    def _stage(self, seg: Segment) -> bool:
        """With the lock held: past the prefetch window, read `seg` (frozen) from nvme into host memory if it is
        only there and room frees without waiting, taking it only from copies needed after every copy in use
        (`_fit`'s `furthest`); whether the walk may go on."""
        if seg.staged or seg.state.tier != "nvme":
            return True  # staged already, or on host: the window brings it the rest of the way
        if not self.config.prefetch_bytes or self._staged_bytes + seg.host_charge > self.config.host_budget // 2:
            return False
        return self._start_prefetch(seg, "host", staged=True) is not None

    def _start_prefetch(self, seg: Segment, tier: Tier, staged: bool = False) -> Handle | None:
        """With the lock held: start an unpinned move of `seg` to `tier` and count it (`staged`: by `_stage`); None
        where no room frees without waiting."""
        handle = self._bring(seg, tier, pin=False, blocking=False, staged=staged)
        if handle is not None:
            self._unprefetch(seg)  # counted once: a copy prefetched (or staged) before now counts for this move
            seg.prefetched, seg.staged = True, staged
            if staged:
                self._staged_bytes += seg.host_charge
            else:
                self._prefetched_bytes += seg.nbytes
            self.stats.prefetches += 1
            handle.add_done_callback(lambda h: self._uncount_failed(seg, h))
        return handle

    def _uncount_failed(self, seg: Segment, handle: Handle) -> None:
        """A prefetch that failed left the segment where it was: it no longer counts as prefetched (unless a
        later move of it is under way)."""
        if handle.error is not None:
            with self._lock:
                if not seg.state.moving:
                    self._unprefetch(seg)

    def _unprefetch(self, seg: Segment) -> None:
        if seg.staged:
            self._staged_bytes -= seg.host_charge
        elif seg.prefetched:
            self._prefetched_bytes -= seg.nbytes
        seg.prefetched = seg.staged = False
