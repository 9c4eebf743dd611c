"""HostBufferPool: 4 KiB-aligned host buffers, pinned when CUDA is present, reused, under a hard budget."""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import torch

from .aligned import align_up, aligned_empty
from .errors import BudgetExceededError, TieringConfigError


@dataclass(frozen=True, kw_only=True)
class HostPoolConfig:
    budget: int
    """Hard cap in bytes on the memory the pool holds, buffers in use and cached alike."""

    pin: bool | None = None
    """Page-lock the buffers (fast, asynchronous host<->device copies). None: pin when CUDA is available."""

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or self.budget < 0:
            raise TieringConfigError("host budget", self.budget, "a non-negative integer of bytes")
        if self.pin not in (None, True, False):
            raise TieringConfigError("pin_memory", self.pin, "true, false or null")


class HostBuffer:
    """A buffer lent by the pool. `tensor` is a uint8 view of `nbytes` (the request); `capacity` bytes are
    owned, aligned and safe for O_DIRECT I/O of `nbytes` rounded up to 4 KiB. Return it with `release()`.
    One lent `unmade` (see HostBufferPool.acquire) has its bytes counted but no memory until `make()`."""

    __slots__ = ("pool", "storage", "nbytes", "what", "unmade")

    def __init__(self, pool: HostBufferPool, storage: torch.Tensor | None, nbytes: int, what: str, unmade: int = 0):
        self.pool, self.storage, self.nbytes, self.what = pool, storage, nbytes, what
        self.unmade = unmade
        """Bytes counted for a buffer not allocated yet (0 once made, or when it came from the cache)."""

    def make(self) -> None:
        """Allocate an unmade buffer's memory (touching its pages: slow, so outside the caller's locks)."""
        if self.unmade:
            self.storage = self.pool.allocate(self.unmade)
            self.unmade = 0

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

    A request is served from the smallest cached buffer that fits, if that is at most twice its size (a
    larger one would count against the budget for bytes nobody uses); otherwise a new buffer is allocated
    (and touched once), first dropping cached buffers, the smallest first, if the budget needs the room. If buffers in use leave no
    room, `acquire` raises BudgetExceededError with the budget, the bytes in use and the bytes requested.
    """

    def __init__(self, config: HostPoolConfig):
        self.config = config
        self.pin = torch.cuda.is_available() if config.pin is None else config.pin
        self._cached: list[torch.Tensor] = []
        self._held = 0  # bytes allocated: in use + cached
        self._in_use = 0
        self.peak_in_use = 0
        self.allocations = 0
        self._lock = threading.Lock()

    @property
    def budget(self) -> int:
        return self.config.budget

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def held(self) -> int:
        return self._held

    def acquire(self, nbytes: int, what: str = "", *, unmade: bool = False) -> HostBuffer:
        """A buffer of at least `nbytes`. `unmade`: where no cached buffer serves, only count its bytes now and
        leave allocating it to the buffer's `make()` (a fresh buffer's pages take ~10 ms a 100 MB to touch)."""
        size = align_up(max(nbytes, 1))
        with self._lock:
            storage = self._take_cached(size)
            if storage is None:
                if self._in_use + size > self.budget:
                    raise BudgetExceededError("host", self.budget, self._in_use, size, what)
                while self._held + size > self.budget:
                    self._held -= self._cached.pop(0).numel()  # drop the smallest cached buffer
                self._held += size
                self.allocations += 1
            self._in_use += storage.numel() if storage is not None else size
            self.peak_in_use = max(self.peak_in_use, self._in_use)
        if storage is None:
            if unmade:
                return HostBuffer(self, None, nbytes, what, unmade=size)
            storage = self.allocate(size)
        return HostBuffer(self, storage, nbytes, what)

    def allocate(self, size: int) -> torch.Tensor:
        """The memory of a buffer of `size` bytes counted already; on failure the count is given back."""
        try:
            return aligned_empty(size, pin=self.pin)
        except BaseException:
            with self._lock:
                self._held -= size
                self._in_use -= size
            raise

    def _take_cached(self, size: int) -> torch.Tensor | None:
        for i, storage in enumerate(self._cached):  # sorted by size: the first fit is the best fit
            if storage.numel() >= size:
                return self._cached.pop(i) if storage.numel() <= 2 * size else None
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
            bisect.insort(self._cached, storage, key=torch.Tensor.numel)

    def trim(self) -> int:
        """Free every cached buffer; returns the bytes given back."""
        with self._lock:
            freed = sum(s.numel() for s in self._cached)
            self._cached.clear()
            self._held -= freed
        return freed
