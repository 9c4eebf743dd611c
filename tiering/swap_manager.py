"""SwapManager: owns every segment, knows where each lives, moves segments among device, host and nvme
asynchronously, keeps every tier within its budget, and follows the recorded trace to have a segment where
it is needed before it is needed. It knows segments only: no modules, no optimizers."""
from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator

import torch

from .checksum import checksum
from .device_tier import DeviceTier
from .errors import ChecksumMismatchError, IllegalTransitionError, TieringConfigError, TieringError
from .eviction import DONE, Eviction, Kind, Outcome
from .handle import Handle, completed
from .host_pool import HostBufferPool, HostPoolConfig
from .adoption import Adoption
from .intents import Intents
from .kept import Keeping
from .read_ahead import ReadAhead
from .reservations import Reservations
from .rehoming import Rehoming
from .nvme_store import NvmeStore
from .residency import TIER_ORDER, Residency, Tier
from .segment import Segment
from .swap_config import SwapConfig
from .timeline import SwapStats, Timeline
from .trace import Trace

STALL_THRESHOLD_S = 1e-4  # an acquire shorter than this only did bookkeeping (the bytes were there)


class SwapManager(Adoption, Eviction, Intents, Keeping, ReadAhead, Rehoming, Reservations):
    """Segments moved among tiers under hard budgets.

    The calls: `register` a segment with a home tier (or `adopt` a device tensor as one); `fetch` it to a tier (pins it there) or `acquire` it
    (fetch, wait, and return a tensor view); `release` it (with `dirty=True` when the view was written, which
    makes those bytes the segment's); `evict` it to its home; `prefetch` a list. Each returns a Handle. A
    segment whose bytes are spent (a gradient once stepped) is released with `discard=True` and fetched next
    with `overwrite=True`: no I/O moves bytes nobody will read. When a tier is full the segment needed farthest
    in the future per the trace is evicted (Belady), or the least recently used one before a trace exists; first
    of all a copy its user said it will overwrite next (`expect_overwrite`) once its home holds the bytes. If
    nothing can go, BudgetExceededError says by how much, or StoreFullError that the disk under the store is
    full (a copy that cannot be written there stays as it is; a prefetch then waits). A user that writes a
    segment speculatively `keep`s its bytes first and then `commit`s or `restore`s them (see kept.py).
    `fetch` blocks only to wait for room or for a move of the same segment already under way; the move it
    starts runs in the background (`rehome` moves homes: rehoming.py). Call `end_step()` at each step boundary.
    """

    def __init__(self, config: SwapConfig, *, device: torch.device | None = None):
        self.config = config
        self.pool = HostBufferPool(HostPoolConfig(budget=config.host_budget, pin=config.pin, arena=True))
        self.device_tier = DeviceTier(config.device_budget, device)
        self.store = NvmeStore(config.nvme) if config.nvme is not None else None
        self.segments: dict[str, Segment] = {}
        self.trace = Trace()
        self.stats = SwapStats()
        self.timeline = Timeline(config.timeline)
        self._lock = threading.RLock()
        self._tick = 0
        self._prefetched_bytes = 0
        self._staged_bytes = 0
        self._cow_pending = 0
        """Bytes of kept segments whose next write-back needs a fresh extent (see kept.py), which `keep` counts
        against the nvme budget before they are allocated."""
        self._read_ahead: list[tuple[Segment, Tier]] = []
        """What the last `prefetch` call could not start for want of room, in its order: started as room
        frees (a write landing, a fetch, a release), so a caller's read-ahead keeps the disk queue full."""
        self._closing = False  # no prefetch may start once close() began
        self._thread = threading.local()  # per thread: `untraced` inside untraced(), `writing` in eviction._write
        self._allocator = ThreadPoolExecutor(1, thread_name_prefix="tiering-alloc")
        """Makes fresh host buffers off the lock, in the order they were asked for: those reads land in (_read) and
        those a fetch to overwrite claims (_claim)."""

    # -- registration -------------------------------------------------------------------------------------

    def register(self, name: str, *, dtype: torch.dtype, shape: Iterable[int], home: Tier,
                 data: torch.Tensor | None = None, frozen: bool = False) -> Handle:
        """Add a segment resting in `home`, holding `data` (copied) or zeros. nvme-homed segments are staged
        through a host buffer and written out; the handle is done when the bytes have reached their home.
        `frozen`: steps only read it (frozen weights, inference's): the read-ahead past the prefetch window stages
        it (a write, as a checkpoint's load makes, is written back as any)."""
        if home not in TIER_ORDER:
            raise TieringConfigError("home", home, "one of 'device', 'host', 'nvme'")
        if home == "nvme" and self.store is None:
            raise TieringError(f"segment {name!r} has home 'nvme' but the swap manager has no nvme store")
        seg = Segment(name, dtype, torch.Size(shape), home, Residency.HOST, frozen=frozen)
        if data is not None and (data.dtype != dtype or data.numel() != seg.shape.numel()):
            raise ValueError(f"data for {name!r} is {data.dtype} x {data.numel()}, expected {dtype} x {seg.shape.numel()}")
        with self._lock:
            if name in self.segments:
                raise ValueError(f"segment {name!r} is already registered")
            self._fit("device" if home == "device" else "host", seg, blocking=True, wait=True)
            if name in self.segments:  # registered by another thread while room was made (the lock let go)
                raise ValueError(f"segment {name!r} is already registered")
            if home == "device":
                seg.device = self.device_tier.allocate(seg.nbytes, name)
                seg.state = Residency.DEVICE
            else:
                seg.host = self.pool.acquire(seg.nbytes, name)
                seg.host_current = True
            self._note_peaks()
            tier = seg.state.tier
            view = seg.view(tier)
            if data is None:
                view.zero_()
            else:
                view.copy_(data.reshape(seg.shape))
            try:
                handle = self._write_back(seg) if home == "nvme" else completed(name)
            except BaseException:  # no room in the store: the segment was never registered
                self._drop_host(seg)
                raise
            self.segments[name] = seg
            return handle

    def unregister(self, name: str) -> None:
        """Forget a segment and free its copies in every tier. It must not be pinned; a move under way (its
        registration's write, a prefetch, an eviction: none of them the caller's to wait for) is waited for."""
        while True:
            with self._lock:
                seg = self._get(name)
                if seg.pins:
                    raise IllegalTransitionError(name, "unregister", "unpinned", f"pinned {seg.pins} times in {seg.pinned_tier}")
                pending = seg.move
                if pending is None:
                    self._forget(seg)
                    self._unprefetch(seg)
                    self._read_ahead = [(s, t) for s, t in self._read_ahead if s is not seg]
                    del self.segments[name]
                    return
            try:
                pending.wait()
            except TieringError:
                pass  # the move was rolled back; its error is its waiters' news, and the segment is going

    # -- the user's calls ---------------------------------------------------------------------------------

    def fetch(self, name: str, tier: Tier = "device", *, overwrite: bool = False) -> Handle:
        """Bring the segment to `tier` and pin it there; the handle is done when `view(name)` is valid.
        `overwrite=True`: the caller writes every byte before reading any and releases it dirty, so only room
        is made (the stored bytes are not read); the bytes count as discarded from this call on, even if it
        fails. A discarded segment must be fetched this way."""
        with self._lock:
            seg = self._get(name)
            self._check_fetch(seg, tier, overwrite)
            seg.spent = overwrite
            seg.overwrite_expected = seg.fetch_expected = False
            if not getattr(self._thread, "untraced", False):
                self.trace.record(name, tier, seg.nbytes, overwrite)
            self._tick += 1
            seg.last_use = self._tick
            if overwrite or seg.prefetched or seg.state.tier == tier:
                self.stats.hits += 1
            else:
                self.stats.misses += 1
            self._unprefetch(seg)
        handle = self._bring(seg, tier, pin=True, blocking=True, overwrite=overwrite)
        self._prefetch_ahead()
        return handle

    def acquire(self, name: str, tier: Tier = "device", *, overwrite: bool = False) -> torch.Tensor:
        """Blocking fetch: the segment's tensor in `tier`, valid until `release`. Time spent here beyond
        bookkeeping (waiting for room or for the bytes) is counted as stall."""
        start = time.perf_counter()
        handle = self.fetch(name, tier, overwrite=overwrite)
        handle.wait()
        self.note_stall(name, start, time.perf_counter())
        return self.view(name)

    def note_stall(self, name: str, start: float, end: float) -> None:
        """Count a wait for `name`'s bytes (here in `acquire`, or a caller's wait for a copy of them) as stall,
        unless it was only bookkeeping."""
        if end - start > STALL_THRESHOLD_S:
            self.stats.stall_seconds += end - start
            self.timeline.add(name, "stall", start, end)

    def moving(self, name: str) -> bool:
        """Whether a move of the segment is under way (a fetch now would wait for it)."""
        with self._lock:
            return self._get(name).state.moving

    @contextlib.contextmanager
    def held(self, name: str, tier: Tier = "device", *, dirty: bool = False, discard: bool = False,
             overwrite: bool = False) -> Iterator[torch.Tensor]:
        """`acquire` for the length of a block: the segment's tensor in `tier`, released as asked (`dirty`,
        `discard`: see `release`) when the block ends, also when it raises; a tensor written part way is still
        released dirty. `overwrite`: see `fetch`."""
        tensor = self.acquire(name, tier, overwrite=overwrite)
        try:
            yield tensor
        finally:
            self.release(name, dirty=dirty, discard=discard)

    def view(self, name: str) -> torch.Tensor:
        """The tensor of a pinned segment in the tier it is pinned in (no copy)."""
        with self._lock:
            seg = self._get(name)
            if not seg.pins or seg.state.moving:
                raise IllegalTransitionError(name, "view", "pinned and settled", f"{seg.state.name} with {seg.pins} pins")
            return seg.view(seg.pinned_tier)

    def release(self, name: str, *, dirty: bool = False, discard: bool = False) -> Handle:
        """Unpin one use. `dirty=True`: the view was written, so copies in lower tiers are now stale.
        `discard=True`: nobody needs the bytes any more; once unpinned, the copies above home are dropped
        unwritten and the next fetch must overwrite."""
        handle = self._release(name, dirty, discard)
        if self._read_ahead:  # the room it freed (a copy dropped, a write begun) may be what a read-ahead waits for
            self._prefetch_ahead()
        return handle

    def release_after(self, name: str, handle: Handle) -> None:
        """`release(name)` once `handle` is done (a copy reading the pinned bytes, whose end the caller's compute
        does not wait on): until then a fetch that finds its tier full waits on `handle`, as on a write-back,
        instead of finding only pinned copies there."""
        with self._lock:
            self._get(name).releasing = handle

        def done(_: Handle) -> None:
            with self._lock:
                seg = self._get(name)
                if seg.releasing is handle:  # not a later copy's, of a second pin
                    seg.releasing = None
            self.release(name)

        handle.add_done_callback(done)

    def _release(self, name: str, dirty: bool, discard: bool) -> Handle:
        if dirty and discard:
            raise ValueError(f"release of {name!r}: dirty and discard contradict each other")
        with self._lock:
            seg = self._get(name)
            if not seg.pins:
                raise IllegalTransitionError(name, "release", "pinned", "not pinned")
            if dirty:
                seg.spent = False
                seg.nvme_current, seg.writes = False, seg.writes + 1
                if seg.pinned_tier == "device":
                    seg.host_current = False
            seg.unpin()
            if seg.pins:
                return completed(name)
            if discard:
                seg.spent = True
                self._unprefetch(seg)
                while seg.state.tier not in (None, seg.home):  # each step drops a copy unwritten
                    if self._evict_step(seg, blocking=False).kind is not Kind.DONE:
                        break  # a device copy needing a host buffer at home: moved, as any eviction
                return completed(name)
            if self._write_behind(seg):
                return completed(name)
            distance = self.config.reuse_distance
            # Evict early only a device copy, and only when the trace says its next use is far (without a trace
            # nobody knows). A host copy stays until room is short: Belady's rule then keeps what a step reuses,
            # where evicting it at release would write it and read it back every step.
            if distance is None or seg.state != Residency.DEVICE or seg.home == "device" or not self.trace.ready:
                return completed(name)
            if self.trace.next_use_bytes(name) <= distance:
                return completed(name)
            step = self._evict_step(seg, blocking=False)
            return step.handle if step.kind is Kind.STARTED else completed(name)

    def _write_behind(self, seg: Segment) -> bool:
        """Start writing a released dirty host copy to nvme now, keeping it (see `_clean`), when it cannot stay
        until its next use anyway: the trace says more bytes than the host budget are fetched before then, so
        Belady's rule will have evicted it. Its write then runs while compute goes on, not when a read is
        waiting for its room. Without a trace nobody knows, and nothing is written early. True if the write
        started."""
        if (seg.state != Residency.HOST or seg.home != "nvme" or seg.nvme_current or seg.spent or self._closing
                or seg.overwrite_expected or seg.fetch_expected):
            return False  # hinted: its bytes are read soon, or most likely never
        if not self.trace.ready or self.trace.next_use_bytes(seg.name) <= self._budget("host"):
            return False
        try:
            self._clean(seg)
        except TieringError:  # no room on nvme now: evicting it later writes it and reports the error
            return False
        return True

    def evict(self, name: str) -> Handle:
        """Move the segment down to its home tier, writing back what lower tiers lack; frees its room above.
        Waits for intermediate steps (device->host before host->nvme); the handle covers the last one."""
        while True:
            with self._lock:
                seg = self._get(name)
                if seg.pins:
                    raise IllegalTransitionError(name, "evict", "unpinned", f"pinned {seg.pins} times in {seg.pinned_tier}")
                self._unprefetch(seg)  # its prefetch is undone: no longer counts against prefetch_bytes
                if seg.state.moving:
                    pending = seg.move
                else:
                    step = self._evict_step(seg, blocking=True)  # blocking: never BLOCKED
                    if step.kind is Kind.DONE and seg.state.tier == seg.home:
                        return completed(name)
                    if step.kind is Kind.STARTED and seg.lands_home:
                        return step.handle
                    # DONE: a copy dropped at once, None to wait for; STARTED: a move part way home; WAIT: room
                    pending = step.handle
            if pending is not None:
                pending.wait()

    def end_step(self) -> None:
        """Mark a step boundary: the trace adopts this step's order if it changed."""
        with self._lock:
            self.trace.end_step()

    @contextlib.contextmanager
    def untraced(self):
        """This thread's fetches inside the block are kept out of the trace: a second thread (a background
        optimizer step) whose fetches interleave with the first's differently every step would otherwise
        make the trace depart every step. Such segments look unneeded to Belady (evicted first) and are not
        prefetched: the thread reads ahead itself with `prefetch`."""
        self._thread.untraced = True
        try:
            yield
        finally:
            self._thread.untraced = False

    def compute(self, name: str):
        """Context manager marking a compute span on the timeline."""
        return self.timeline.span(name, "compute")

    def write_chrome_trace(self, path: str) -> None:
        self.timeline.write_chrome_trace(path)

    def close(self) -> None:
        """Wait for every move, free every buffer, remove the store's file. The memory goes back here, not
        when the manager is collected: whoever holds it (an engine in a reference cycle) holds no buffer."""
        with self._lock:
            self._closing = True
        while True:  # until none is left: a move may start while another is waited for (a write-back making room)
            with self._lock:
                moves = [seg.move for seg in self.segments.values() if seg.move is not None]
            if not moves:
                break
            for move in moves:
                with contextlib.suppress(TieringError):  # closing: whoever waited on the move was told
                    move.wait()
        self._allocator.shutdown()
        self.device_tier.close()
        with self._lock:
            for seg in self.segments.values():
                self._forget(seg)
            self.segments.clear()
        self.pool.trim()
        if self.device_tier.pool is not None:
            self.device_tier.pool.trim()
        if self.store is not None:
            self.store.close()

    def __enter__(self) -> SwapManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- bringing a segment up ------------------------------------------------------------------------------

    def _check_fetch(self, seg: Segment, tier: Tier, overwrite: bool) -> None:
        """What a fetch to `tier` needs; checked again whenever `_bring` takes the lock (pinned or discarded since)."""
        self._check_target(seg, tier)
        if overwrite and seg.pins:
            raise IllegalTransitionError(seg.name, "fetch to overwrite", "unpinned", f"pinned {seg.pins} times")
        if seg.spent and not overwrite:
            raise IllegalTransitionError(seg.name, "fetch", "bytes to read (fetch it with overwrite=True)",
                                         "discarded")

    def _check_target(self, seg: Segment, tier: Tier) -> None:
        if tier not in ("device", "host"):
            raise TieringConfigError("tier", tier, "'device' or 'host'")
        if TIER_ORDER[tier] < TIER_ORDER[seg.home]:
            raise IllegalTransitionError(seg.name, f"fetch to {tier}", f"a tier at or above its home {seg.home!r}", tier)
        if seg.pins and seg.pinned_tier != tier:
            raise IllegalTransitionError(seg.name, f"fetch to {tier}", f"unpinned or pinned in {tier}",
                                         f"pinned in {seg.pinned_tier}")

    def _bring(self, seg: Segment, tier: Tier, *, pin: bool, blocking: bool, staged: bool = False,
               overwrite: bool = False) -> Handle | None:
        """Start the moves that put `seg` in `tier`. Blocking: wait (outside the lock) for room or for a move
        of `seg` already in flight, then retry. Not blocking: None if that would be needed. `staged`: see
        `_start_up`. `pin`: for a fetch (`overwrite` as it was asked), whose checks hold each time."""
        while True:
            with self._lock:
                if pin:
                    self._check_fetch(seg, tier, overwrite)
                wait_on = seg.move if seg.state.moving else None
                own = wait_on is not None  # waiting on a move of `seg` itself, not for room
                if wait_on is None and seg.state == Residency.DEVICE and tier == "host":
                    step = self._evict_step(seg, blocking=blocking)  # down to host first
                    if step.kind is Kind.BLOCKED:
                        return None
                    wait_on = step.handle  # None when DONE; started here, so its failure is raised, not retried
                if wait_on is None:
                    up = self._start_up(seg, tier, blocking, staged)
                    if up.kind is Kind.BLOCKED:
                        return None
                    if up.kind is Kind.WAIT:
                        wait_on = up.handle
                    else:  # DONE (in `tier` at once) or STARTED (moves under way)
                        handle = up.handle if up.kind is Kind.STARTED else completed(seg.name)
                        if pin:
                            seg.pins += 1
                            seg.pinned_tier = tier
                            # (at once where the move already failed: a read refused on this thread)
                            handle.add_done_callback(lambda h, s=seg: self._unpin_on_failure(s, h))
                        return handle
            if not blocking:
                return None
            try:
                wait_on.wait()
            except TieringError:
                if seg.state.moving or not own:
                    raise  # making room failed (e.g. a write-back on a full disk): retrying would fail again
                # A failed move of this segment (a prefetch): its state was rolled back; try again from there.

    def _unpin_on_failure(self, seg: Segment, handle: Handle) -> None:
        if handle.error is not None:
            with self._lock:
                seg.unpin()

    def _start_up(self, seg: Segment, tier: Tier, blocking: bool, staged: bool = False) -> Outcome:
        """With the lock held and `seg` settled: reserve the room `seg` needs and start its moves up to `tier`.
        STARTED with the handle of the last move, DONE when nothing had to move (its bytes were in `tier`, or a
        spent segment claimed its buffer), WAIT for room being made, or BLOCKED (not blocking, no room).
        `staged` (a read-ahead past the prefetch window): room only from copies needed after every copy in use
        (see `_fit`'s `furthest`)."""
        need_device = tier == "device" and seg.state != Residency.DEVICE
        need_host = seg.state == Residency.NVME and seg.host is None and not (seg.spent and need_device)
        horizon = None if blocking else self.trace.next_use(seg.name)
        for needed, t in ((need_host, "host"), (need_device, "device")):
            if needed:
                fit = self._fit(t, seg, blocking=blocking, horizon=horizon, furthest=staged)
                if fit.kind is not Kind.DONE:
                    return fit
        if need_host:  # a fresh buffer is made on the allocator, off the lock (_read, _claim)
            seg.host = self.pool.acquire(seg.nbytes, seg.name, unmade=True)
        if need_device:
            seg.device = self.device_tier.allocate(seg.nbytes, seg.name)
        self._note_peaks()
        if seg.spent:  # its buffer is all the caller needs; the copy in `tier` becomes the one that counts
            if need_device:
                seg.to("claim_device" if seg.state == Residency.HOST else "claim_device_from_nvme")
            elif seg.state == Residency.NVME:
                if not seg.host.made:
                    return Outcome(Kind.STARTED, self._claim(seg))
                seg.to("claim_host")
            seg.host_current = tier == "host"
            seg.nvme_current = False
            return DONE
        if seg.state == Residency.NVME:
            return Outcome(Kind.STARTED, self._read(seg, then_device=tier == "device"))
        if seg.state == Residency.HOST and tier == "device":
            return Outcome(Kind.STARTED, self._to_device(seg))
        return DONE

    def _read(self, seg: Segment, then_device: bool) -> Handle:
        """Read `seg` from nvme into its host buffer, which the allocator makes first where it is fresh (the pages
        of 100 MB take ~10 ms to touch: under the lock, every other thread and the I/O's completions would wait)."""
        final, start = self._begin(seg, "read", "fetch", None)

        def submit() -> None:
            try:
                seg.host.make()
                read = self.store.read(seg.extent, seg.host.storage, seg.nbytes)
            except BaseException as exc:  # noqa: BLE001  (the move fails with it, as a failed read does)
                read = Handle(label=f"read {seg.name}")
                read.part_done(exc)
            read.add_done_callback(read_done)

        def read_done(h: Handle) -> None:
            error = h.error
            if error is None and self.config.checksums:
                actual = checksum(seg.storage("host"))
                if actual != seg.checksum:
                    error = ChecksumMismatchError(seg.name, self.store.path_of(seg.extent), seg.extent.offset, seg.checksum,
                                                  actual)
            with self._lock:
                self._account("nvme->host", seg, start)
                if error is not None:
                    seg.to("read_failed")
                    self._drop_host(seg)
                    self._drop_device(seg)
                    seg.move = None
                else:
                    seg.to("read_done")
                    seg.host_current = True
                    if then_device:
                        self._to_device(seg, final)
                        return
                    seg.move = None
            final.part_done(error)

        if not seg.host.made:
            self._allocator.submit(submit)
        else:
            submit()
        return final

    def _claim(self, seg: Segment) -> Handle:
        """A spent segment's host buffer, fresh, made on the allocator off the lock: the segment moves ("read",
        nothing read) until it is, so no one else sees it without its memory."""
        final, _ = self._begin(seg, "read", "claim", None)

        def make() -> None:
            error = None
            try:
                seg.host.make()
            except BaseException as exc:  # noqa: BLE001  (the claim fails with it)
                error = exc
            with self._lock:
                seg.move = None
                if error is not None:
                    seg.to("read_failed")
                    self._drop_host(seg)
                else:
                    seg.to("read_done")
                    seg.host_current = True
                    seg.nvme_current = False
            final.part_done(error)

        self._allocator.submit(make)
        return final

    def _to_device(self, seg: Segment, final: Handle | None = None) -> Handle:
        final, start = self._begin(seg, "to_device", "fetch", final)
        copy = Handle(label=f"host->device {seg.name}")

        def copied(h: Handle) -> None:
            with self._lock:
                self._account("host->device", seg, start)
                seg.move = None
                if h.error is not None:
                    seg.to("to_device_failed")
                    self._drop_device(seg)
                else:
                    seg.to("to_device_done")
            final.part_done(h.error)

        copy.add_done_callback(copied)
        self.device_tier.copy(seg.storage("device"), seg.storage("host"), copy)
        return final

    def _begin(self, seg: Segment, action: str, label: str, final: Handle | None) -> tuple[Handle, float]:
        """Start a move of `seg`: apply `action`, and give the handle callers wait on and the start time."""
        seg.to(action)
        seg.move = final or Handle(label=f"{label} {seg.name}")
        return seg.move, time.perf_counter()

    def _settle(self, seg: Segment, pair: str, start: float, action: str, final: Handle, error, landed) -> None:
        """End a move of `seg` along `pair`: account it, apply `<action>_done` and `landed()` (or
        `<action>_failed`), then complete `final`."""
        with self._lock:
            self._account(pair, seg, start)
            seg.move = None
            if error is not None:
                seg.to(f"{action}_failed")
            else:
                seg.to(f"{action}_done")
                landed()
        final.part_done(error)

    # -- bookkeeping ----------------------------------------------------------------------------------------

    def _get(self, name: str) -> Segment:
        if name not in self.segments:
            raise KeyError(f"no segment named {name!r}")
        return self.segments[name]

    def _forget(self, seg: Segment) -> None:
        """Free the segment's copies in every tier and its kept copy (it is going)."""
        self._drop_device(seg)
        self._drop_host(seg)
        if seg.kept is not None:
            self._free_kept(seg, seg.kept)
            seg.kept = None
        if seg.extent is not None:
            self.store.free(seg.extent)

    def _drop_device(self, seg: Segment) -> None:
        if seg.device is not None:
            self.device_tier.free(seg.device)
            seg.device = None

    def _drop_host(self, seg: Segment) -> None:
        if seg.host is not None:
            seg.host.release()
            seg.host = None
        seg.host_current = False

    def _account(self, pair: str, seg: Segment, start: float) -> None:
        self.stats.bytes_moved[pair] += seg.nbytes
        self.stats.segment_bytes[pair][seg.name] += seg.nbytes
        self.timeline.add(seg.name, pair, start, time.perf_counter(), bytes=seg.nbytes)

    def _note_peaks(self) -> None:
        for tier, used in (("device", self.device_tier.in_use), ("host", self.pool.in_use)):
            self.stats.peak_bytes[tier] = max(self.stats.peak_bytes[tier], used)
