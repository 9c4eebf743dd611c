"""HostBufferPool: 4 KiB-aligned host buffers, pinned when CUDA is present, reused, under a hard budget."""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import torch

from .aligned import align_up, aligned_empty
from .errors import BudgetExceededError, TieringConfigError
from .host_arena import FRAME, HostArena, max_frames


@dataclass(frozen=True, kw_only=True)
class HostPoolConfig:
    budget: int
    """Hard cap in bytes on the memory the pool holds, buffers in use and cached alike."""

    pin: bool | None = None
    """Page-lock the buffers (fast, asynchronous host<->device copies). None: pin when CUDA is available."""

    arena: bool = False
    """Lend buffers of 2 MiB or more from a HostArena (unpinned buffers, a finite budget): freed memory serves
    any later size. Its buffers are views of one mapping: not for a caller that keeps a buffer's storage."""

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or self.budget < 0:
            raise TieringConfigError("host budget", self.budget, "a non-negative integer of bytes")
        if self.pin not in (None, True, False):
            raise TieringConfigError("pin_memory", self.pin, "true, false or null")


ARENA_RESERVE = (1.25, 3)
"""An arena's address space, in budgets, at least and at most: a lent run needs a free run as long, wherever frames
lie (a request that finds none gets a whole buffer); the most the kernel's mapping limit allows in between."""


class HostBuffer:
    """A buffer lent by the pool. `tensor` is a uint8 view of `nbytes` (the request); `capacity` bytes are
    owned, aligned and safe for O_DIRECT I/O of `nbytes` rounded up to 4 KiB. Return it with `release()`.
    One lent `unmade` (see HostBufferPool.acquire) has its bytes counted but not all its pages until `make()`."""

    __slots__ = ("pool", "storage", "nbytes", "what", "unmade", "spans")

    def __init__(self, pool: HostBufferPool, storage: torch.Tensor | None, nbytes: int, what: str, unmade: int = 0,
                 spans: list[tuple[int, int]] | None = None):
        self.pool, self.storage, self.nbytes, self.what = pool, storage, nbytes, what
        self.unmade = unmade
        """Bytes counted for a buffer not allocated yet (0 once made, or when it came from the cache)."""
        self.spans = spans
        """An arena buffer's byte spans (in the arena) still to fault in; None once made."""

    @property
    def made(self) -> bool:
        return not self.unmade and not self.spans

    def make(self) -> None:
        """Allocate an unmade buffer's memory, or fault in its pages (slow, so outside the caller's locks). On
        failure the buffer stays unmade, its bytes still counted: its `release()` gives them back, once."""
        if self.unmade:
            self.storage = aligned_empty(self.unmade, pin=self.pool.pin)
            self.unmade = 0
        if self.spans:
            self.pool.arena.touch(self.spans)
        self.spans = None

    @property
    def capacity(self) -> int:
        return self.storage.numel() if self.storage is not None else self.unmade

    @property
    def tensor(self) -> torch.Tensor:
        return self.storage[: self.nbytes]

    def view(self, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        """The first bytes as a tensor of `dtype` and `shape` (no copy)."""
        count = 1
        for dim in shape:
            count *= dim
        return self.storage[: count * dtype.itemsize].view(dtype).view(shape)

    def release(self) -> None:
        self.pool.release(self)

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class HostBufferPool:
    """Lends aligned host buffers and takes them back for reuse, never holding more than `budget` bytes.

    A request of 2 MiB or more is lent from a HostArena where the config asks for one: its freed frames serve
    requests of any size. Another is served from the smallest cached buffer that fits, if that is at most twice
    its size (a larger one would count against the budget for bytes nobody uses) and its excess, with that of the
    buffers in use, within `spare` (the budget's slack over what its user needs at least); otherwise a new buffer is
    allocated (and touched once), first dropping cached buffers, the smallest first, then the arena's free frames,
    if the budget needs the room. If buffers in use leave no room, `acquire` raises BudgetExceededError with the
    budget, the bytes in use and the bytes requested.
    """

    def __init__(self, config: HostPoolConfig):
        self.config = config
        self.pin = torch.cuda.is_available() if config.pin is None else config.pin
        self._cached: list[torch.Tensor] = []
        self._held = 0  # bytes of whole buffers allocated: in use + cached (the arena counts its own)
        self._in_use = 0
        self.peak_in_use = 0
        self.allocations = 0
        self.fresh_bytes = 0
        """Bytes of new pages so far: whole buffers allocated and arena spans to fault in (a pinned buffer's are
        page-locked too): the pool's churn, where a step's buffers change size."""
        self.spare: int | None = None
        """Bytes the cached buffers lent may hold beyond their requests, together (None: no limit). The engine sets
        it to the budget less its least host budget, so that a run at that least budget is lent what it asks."""
        self._excess = 0
        self.arena = self._make_arena()
        self._lock = threading.Lock()

    def _make_arena(self) -> HostArena | None:
        """An arena of ARENA_RESERVE budgets of address space (room for free runs between lent ones), where the
        config asks for one, the buffers are unpinned and the budget is small enough to reserve that much (and the
        kernel lets it: strict overcommit counts the reserve as memory)."""
        least, most = (int(reserve * self.budget) // FRAME for reserve in ARENA_RESERVE)
        frames = min(most, max_frames())
        if not self.config.arena or self.pin or frames < max(least, 1):
            return None
        try:
            return HostArena(frames * FRAME)
        except OSError:
            return None

    @property
    def budget(self) -> int:
        return self.config.budget

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def held(self) -> int:
        return self._held + (self.arena.populated if self.arena is not None else 0)

    def acquire(self, nbytes: int, what: str = "", *, unmade: bool = False) -> HostBuffer:
        """A buffer of at least `nbytes`. `unmade`: only count its bytes now and leave the page faults (a fresh
        buffer's pages take ~10 ms a 100 MB to touch) to the buffer's `make()`."""
        size = align_up(max(nbytes, 1))
        with self._lock:
            if self._in_use + size > self.budget:
                raise BudgetExceededError("host", self.budget, self._in_use, size, what)
            lent = self._lend(size) if self.arena is not None and size >= FRAME else None
            storage = lent[0] if lent is not None else self._take_cached(size)
            if storage is None:
                self._room(size)
                self.allocations += 1
                self.fresh_bytes += size
            if storage is not None and lent is None:
                self._excess += storage.numel() - size
            self._in_use += size if storage is None else storage.numel()
            self.peak_in_use = max(self.peak_in_use, self._in_use)
        if lent is not None:
            buffer = HostBuffer(self, storage, nbytes, what, spans=lent[1])
        else:
            buffer = HostBuffer(self, storage, nbytes, what, unmade=size if storage is None else 0)
        if not unmade:
            made(buffer)
        return buffer

    def _lend(self, size: int) -> tuple[torch.Tensor, list[tuple[int, int]]] | None:
        """With the lock held: `size` bytes from the arena; None where no free run of it is long enough (a whole
        buffer is allocated instead)."""
        start = self.arena.place(size)
        if start is None:
            return None
        lent = self.arena.lend(start, size)
        self._fit_budget()
        self.allocations += bool(lent[1])
        self.fresh_bytes += sum(end - begin for begin, end in lent[1])
        return lent

    def _room(self, size: int) -> None:
        """With the lock held: count a new whole buffer of `size` bytes, making room for it."""
        self._held += size
        self._fit_budget()

    def _fit_budget(self) -> None:
        """With the lock held: give back cached buffers (the smallest first), then the arena's free frames, while
        the books pass the budget (nothing counted has been touched yet)."""
        while self.held > self.budget and self._cached:
            self._held -= self._cached.pop(0).numel()
        if self.held > self.budget:
            self.arena.shed(self.held - self.budget)

    def _take_cached(self, size: int) -> torch.Tensor | None:
        for i, storage in enumerate(self._cached):  # sorted by size: the first fit is the best fit
            if storage.numel() >= size:
                excess = storage.numel() - size
                fits = excess <= size and (self.spare is None or self._excess + excess <= self.spare)
                return self._cached.pop(i) if fits else None
        return None

    def release(self, buffer: HostBuffer) -> None:
        storage = buffer.storage
        if storage is None:
            if not buffer.unmade:
                raise RuntimeError(f"host buffer {buffer.what!r} released twice")
            with self._lock:  # never made: its count goes, nothing is cached
                self._in_use -= buffer.unmade
                self._held -= buffer.unmade
            buffer.unmade = 0
            return
        buffer.storage = None
        with self._lock:
            self._in_use -= storage.numel()
            if self.arena is not None and self.arena.owns(storage):
                self.arena.give_back(storage, untouched=buffer.spans)
            else:
                self._excess -= storage.numel() - align_up(max(buffer.nbytes, 1))
                bisect.insort(self._cached, storage, key=torch.Tensor.numel)
        buffer.spans = None

    def trim(self) -> int:
        """Free every cached buffer and the arena's free frames; returns the bytes given back."""
        with self._lock:
            freed = sum(s.numel() for s in self._cached)
            self._cached.clear()
            self._held -= freed
            if self.arena is not None:
                freed += self.arena.shed(self.arena.populated)
        return freed


def made(buffer: HostBuffer) -> HostBuffer:
    """`buffer`, made; where that fails, released (its count given back) before the error goes on."""
    try:
        buffer.make()
    except BaseException:
        buffer.pool.release(buffer)
        raise
    return buffer
