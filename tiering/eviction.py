"""Eviction: how the swap manager makes room in a tier (a part of SwapManager, cut out as one concept).

Which copies go (the one needed latest per the trace, Belady's rule, a copy said to be fetched soon counting as
needed now; least recently used before a trace exists), and how a segment moves one tier down toward its home: a
device copy dropped or copied to host, a host copy dropped or written back to nvme. A spent segment's copies are
dropped unwritten. The methods use the manager's state (segments, tiers, store, trace, lock) and its move helpers
(`_begin`, `_settle`).

Every step that may have to wait says what happened as an `Outcome` of a named `Kind`: done, a move of the
segment started, room being made by other moves (wait, then try again), or blocked (only waiting would do,
and the caller may not wait).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from .checksum import checksum
from .errors import BudgetExceededError, StoreFullError
from .handle import Handle, gather, settled
from .residency import Residency, Tier
from .segment import Segment


class Kind(Enum):
    DONE = "done"
    """Nothing to wait for: the room is there, the copy was dropped at once, or there was nothing to move."""
    STARTED = "started"
    """A move of the segment itself began; `handle` is done when it has landed (or failed and rolled back)."""
    WAIT = "wait"
    """Room is being made by moves of other segments: wait on `handle` (outside the lock), then try again."""
    BLOCKED = "blocked"
    """Not blocking, and only waiting would make room: nothing was moved for this segment (write-backs begun
    for room, if any, make room for a later try)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a step of making room or moving a segment did. Callers branch on `kind`, never on truthiness."""

    kind: Kind
    handle: Handle | None = None
    """The handle to wait on: set for STARTED and WAIT, None for DONE and BLOCKED."""

    def __post_init__(self) -> None:
        if (self.handle is not None) != (self.kind in (Kind.STARTED, Kind.WAIT)):
            raise ValueError(f"an outcome {self.kind.name} {'needs' if self.handle is None else 'takes no'} handle")

    def __bool__(self) -> bool:
        raise TypeError("branch on Outcome.kind, not on the outcome's truth")


DONE = Outcome(Kind.DONE)
BLOCKED = Outcome(Kind.BLOCKED)


class Eviction:
    def _used(self, tier: Tier) -> int:
        return self.device_tier.in_use if tier == "device" else self.pool.in_use

    def _budget(self, tier: Tier) -> float:
        budget = self.device_tier.budget if tier == "device" else self.pool.budget
        return math.inf if budget is None else budget

    def _fit(self, tier: Tier, seg: Segment, *, blocking: bool, horizon: float | None = None, wait: bool = False,
             keep: tuple[Segment, ...] = (), furthest: bool = False) -> Outcome:
        """Evict until a copy of `seg` fits in `tier`, never evicting `seg` or `keep` (segments being brought
        up, whose state must not change under them). DONE: it fits now. WAIT: write-backs were started, wait
        and retry (with `wait=True` waited here, the lock released meanwhile, so only DONE comes back).
        BLOCKED: not blocking and only waiting would make room. Raises BudgetExceededError when even evicting
        everything evictable cannot make room, or the StoreFullError of a write-back where that is because the
        disk under the store is full (a victim that cannot be written stays as it is; the next may still go).
        `furthest` (with a horizon): evict only copies needed after every copy in `tier` that is pinned or
        arriving, which become evictable later: a demand fetch at the time of use would take those first (a cyclic
        forward through weights twice the budget keeps its cached part)."""
        # What the copy takes from the budget: host buffers are whole 4 KiB pages.
        nbytes = self.device_tier.charge(seg.nbytes) if tier == "device" else seg.host_charge
        keep = (seg, *keep)
        while True:
            short = self._used(tier) + nbytes - self._budget(tier)
            if short <= 0:
                return DONE
            started: list[Handle] = []
            blocked = full = None
            if furthest and horizon is not None:
                horizon = max(horizon, self._held_until(tier))
            for victim in self._victims(tier, keep):
                later = self._next_use(victim)
                if horizon is not None and victim.overwrite_expected and not self._expendable(victim, tier):
                    continue  # a read-ahead writes back no bytes their user expects to overwrite (most likely wasted)
                if horizon is not None and later <= horizon and not self._expendable(victim, tier):
                    if later < math.inf:
                        break  # a prefetch never evicts what is needed sooner (the rest, sorted, are sooner still)
                    if victim.prefetched:
                        continue  # off the trace both, and this one brought for a read-ahead not yet used
                freed = victim.capacity(tier)
                try:
                    outcome = self._evict_from(victim, tier, blocking, keep)
                except BudgetExceededError as exc:
                    blocked = exc  # no room below for this one; the next victim may still do
                    continue
                except StoreFullError as exc:
                    full = exc  # the disk is full: this one stays as it is; the next victim may still do
                    continue
                match outcome.kind:
                    case Kind.DONE:
                        short -= freed
                    case Kind.STARTED:
                        started.append(outcome.handle)
                        short -= freed
                    case Kind.WAIT | Kind.BLOCKED:
                        pass  # the victim needs room below first: it frees nothing yet
                if short <= 0:
                    break
            if short <= 0 and not started:
                return DONE
            if not blocking:
                return BLOCKED  # write-backs begun (if any) make room for a later try
            moving = [h for s in self.segments.values() if s not in keep for h in (s.move, s.releasing)
                      if h is not None]
            if not started and not moving:
                if full is not None:
                    raise full  # the disk lacks the room, not the tier's budget: say so
                raise BudgetExceededError(tier, int(self._budget(tier)), self._used(tier), nbytes, seg.name,
                                          parts=self.device_tier.parts() if tier == "device" else None) from blocked
            # Another's move frees room when it ends, however it ends: its error is its owner's.
            pending = gather(started, f"room in {tier}") if started else settled(moving[0], f"room in {tier}")
            if not wait:
                return Outcome(Kind.WAIT, pending)
            self._lock.release()
            try:
                pending.wait()
            finally:
                self._lock.acquire()

    def _victims(self, tier: Tier, keep: tuple[Segment, ...]) -> list[Segment]:
        """Segments whose copy in `tier` may go: first those `_expendable`; then the one needed latest first
        (Belady), the least recently used first among those off the trace (all of them before there is one);
        last of all those off the trace that a read-ahead brought and nobody used yet (`prefetch` was told they
        come next)."""
        def order(seg: Segment) -> tuple:
            later = self._next_use(seg)  # a bisect: once per segment
            return not self._expendable(seg, tier), seg.prefetched and later == math.inf, -later, seg.last_use

        out = [seg for seg in self.segments.values() if seg not in keep and seg.evictable_from(tier)]
        out.sort(key=order)
        return out

    def _held_until(self, tier: Tier) -> float:
        """The latest next use among the copies in `tier` that cannot go now but will (pinned, or a move under
        way; homed below `tier`), -1 if none."""
        below = ("nvme",) if tier == "host" else ("host", "nvme")
        held = [self._next_use(s) for s in self.segments.values()
                if (s.device if tier == "device" else s.host) is not None and s.home in below
                and not s.evictable_from(tier)]
        return max(held, default=-1.0)

    def _next_use(self, seg: Segment) -> float:
        """When the segment is used next: per the trace, or now where its user said a fetch off the trace comes
        soon (`expect_fetch`: a gradient a step running during the backward reads next, which the trace places
        at the step's boundary; evicting it first would write it and read it back)."""
        return 0.0 if seg.fetch_expected else self.trace.next_use(seg.name)

    def _expendable(self, seg: Segment, tier: Tier) -> bool:
        """Its user expects to overwrite it next (`expect_overwrite`) and the tier below holds its current bytes:
        dropping its copy in `tier` costs no write now and, most likely, no read later."""
        if not seg.overwrite_expected:
            return False
        below_current = seg.home == "nvme" and seg.nvme_current
        return below_current or (tier == "device" and seg.host_current)

    def _evict_from(self, seg: Segment, tier: Tier, blocking: bool, keep: tuple[Segment, ...] = ()) -> Outcome:
        """Free `seg`'s copy in `tier`: DONE if dropped at once, STARTED for the write-back begun, WAIT or
        BLOCKED if room below must be made first (see `_fit`)."""
        self._unprefetch(seg)
        if tier == "host" and seg.state == Residency.DEVICE:
            self._drop_host(seg)  # a cache under the device copy
            return DONE
        return self._evict_step(seg, blocking, keep)

    def _evict_step(self, seg: Segment, blocking: bool, keep: tuple[Segment, ...] = ()) -> Outcome:
        """Move `seg` one tier down toward home. DONE: nothing to do or done at once; STARTED: the move began;
        WAIT (blocking) or BLOCKED (not blocking): room on host must be made first (never by evicting `keep`)."""
        if seg.spent and seg.state == Residency.HOST and seg.home == "nvme":
            self._drop_host(seg)
            seg.to("drop_host")
            return DONE
        if seg.spent and seg.state == Residency.DEVICE and seg.home != "device" and (seg.host or seg.home == "nvme"):
            self._drop_device(seg)
            seg.to("drop_device_to_host" if seg.host is not None else "drop_device_to_nvme")
            return DONE
        if seg.state == Residency.DEVICE and seg.home != "device":
            if seg.host_current:
                seg.to("drop_device_to_host")
                self._drop_device(seg)
                return DONE
            if seg.nvme_current and seg.home == "nvme":
                self._drop_host(seg)  # a stale cache, if any
                seg.to("drop_device_to_nvme")
                self._drop_device(seg)
                return DONE
            if seg.host is None:
                fit = self._fit("host", seg, blocking=blocking, keep=keep)
                if fit.kind is not Kind.DONE:
                    return fit
                seg.host = self.pool.acquire(seg.nbytes, seg.name)
                self._note_peaks()
            return Outcome(Kind.STARTED, self._to_host(seg))
        if seg.state == Residency.HOST and seg.home == "nvme":
            if seg.nvme_current:
                seg.to("drop_host")
                self._drop_host(seg)
                return DONE
            return Outcome(Kind.STARTED, self._write_back(seg))
        return DONE

    def _to_host(self, seg: Segment) -> Handle:
        final, start = self._begin(seg, "to_host", "evict", None)

        def landed() -> None:
            seg.host_current = True
            self._drop_device(seg)

        copy = Handle(label=f"device->host {seg.name}")
        copy.add_done_callback(lambda h: self._settle(seg, "device->host", start, "to_host", final, h.error, landed))
        self.device_tier.copy(seg.storage("host"), seg.storage("device"), copy)
        return final

    def _write_back(self, seg: Segment) -> Handle:
        """Write the host copy to nvme, then free it. On failure the host copy stays, still current."""
        def landed() -> None:
            seg.nvme_current = True
            self._drop_host(seg)

        return self._write(seg, "write", landed)

    def _clean(self, seg: Segment) -> Handle:
        """Write-behind: write a dirty host copy to nvme and keep it, so that making room later drops it at
        once instead of waiting for a write. A fetch meanwhile waits for the write (the bytes must not change
        under it); a holder whose pin predates it (`keep` cleans pinned copies) may still write: then the copy
        stays dirty. On failure the copy stays dirty, and evicting it writes it (and reports the error) as
        before."""
        began = seg.writes

        def landed() -> None:
            seg.nvme_current = seg.writes == began

        return self._write(seg, "clean", landed)

    def _write(self, seg: Segment, action: str, landed) -> Handle:
        if self._fresh_extent(seg):
            extent = self.store.allocate(seg.nbytes, seg.name)
            if seg.extent is not None:  # the kept copy's: no longer shared
                self._cow_pending -= seg.nvme_charge
            seg.extent = extent
            self.stats.peak_bytes["nvme"] = max(self.stats.peak_bytes["nvme"], self.store.used_bytes)
        final, start = self._begin(seg, action, action, None)

        def written(h: Handle) -> None:
            if h.error is None and self.config.checksums:  # off the lock: the bytes do not change while moving
                seg.checksum = checksum(seg.storage("host"))
            self._settle(seg, "host->nvme", start, action, final, h.error, landed)
            # The room this write freed (or made free to take) may be what a prefetch waits for; not where the
            # write landed before its callback was added (this thread, inside the `_fit` that started it: a read-ahead
            # from there would evict the victims that `_fit` is still walking).
            if h.error is None and not getattr(self._thread, "writing", False):
                self._prefetch_ahead()

        self._thread.writing = True
        try:
            try:
                write = self.store.write(seg.extent, seg.host.storage, seg.nbytes)
            except BaseException as exc:  # noqa: BLE001  (refused at once: the move fails with it, as a failed write)
                write = Handle(label=f"write {seg.name}")
                write.part_done(exc)
            write.add_done_callback(written)
        finally:
            self._thread.writing = False
        return final
