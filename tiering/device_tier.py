"""The device tier: accelerator memory under a hard budget, and the host<->device copy path.

Without CUDA the device tier is host memory counted against the device budget (every code path runs and is
tested on CPU); its buffers come from a pool so steps reuse memory instead of faulting in fresh pages, and its
copies run on a copy worker with completion events, asynchronous as on a GPU (see copy_stream).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from .aligned import align_up
from .copy_stream import CopyEvent, copy_stream_for
from .errors import BudgetExceededError, DeviceOutOfMemoryError
from .handle import Handle
from .host_pool import HostBuffer, HostBufferPool, HostPoolConfig


class DeviceBuffer:
    """Device memory for one segment copy; `storage` is uint8 (same face as a HostBuffer)."""

    __slots__ = ("storage",)

    def __init__(self, storage: torch.Tensor):
        self.storage = storage

    @property
    def capacity(self) -> int:
        return self.storage.numel()

    def release(self) -> None:
        self.storage = None  # the caching allocator takes it back once no stream uses it


def device_charge(nbytes: int, device: torch.device) -> int:
    """Bytes a buffer of `nbytes` on `device` takes from the device budget: the CPU stand-in's pool hands out whole
    4 KiB pages, and the budget counts what is really held (else its pool refuses what the budget allowed)."""
    return align_up(max(nbytes, 1)) if device.type == "cpu" else max(nbytes, 1)


class DeviceTier:
    def __init__(self, budget: int | None, device: torch.device | None = None):
        self.device = _indexed(device or torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        self.budget = budget
        self._lock = threading.Lock()
        self.in_use = 0
        self.peak = 0
        self.reserved: dict[str, int] = {}
        """Bytes the callers allocate themselves, by part (gathered units, the backward's gradients...): with the
        segments' own buffers (the rest of in_use) every byte the budget counts, named in its error."""
        self.pool = (HostBufferPool(HostPoolConfig(budget=budget if budget is not None else 1 << 62, pin=False))
                     if self.device.type == "cpu" else None)
        """Without CUDA: where the tier's memory comes from (with CUDA: the caching allocator)."""
        self._stream = copy_stream_for(self.device)
        # Completes the handles of copies, waiting on their events in the order the copies run: neither the
        # caller nor the copy stream ever waits for a copy to end, so copies pipeline. Handles in tiering are
        # completed by threads; callers never poll streams.
        self._completer = ThreadPoolExecutor(1, thread_name_prefix="tiering-copy-done")
        self._submit_lock = threading.Lock()

    def free_bytes(self) -> int | None:
        return None if self.budget is None else self.budget - self.in_use

    def charge(self, nbytes: int) -> int:
        return device_charge(nbytes, self.device)

    def allocate(self, nbytes: int, what: str) -> DeviceBuffer | HostBuffer:
        """Device storage for `nbytes`; raises BudgetExceededError past the budget (callers evict first)."""
        with self._lock:
            if self.budget is not None and self.in_use + self.charge(nbytes) > self.budget:
                raise BudgetExceededError("device", self.budget, self.in_use, self.charge(nbytes), what,
                                          parts=self.parts())
            if self.pool is not None:
                buffer = self.pool.acquire(nbytes, what)  # within its budget: it lends no more than in_use counts
            else:
                with self.out_of_memory(nbytes, what):
                    buffer = DeviceBuffer(torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device))
            self.in_use += buffer.capacity
            self.peak = max(self.peak, self.in_use)
        return buffer

    def adopt(self, storage: torch.Tensor, what: str) -> DeviceBuffer:
        """Count `storage` (flat uint8, on this tier's device, made by the caller) as a segment's buffer; raises
        BudgetExceededError past the budget. Freeing it drops the reference: torch frees it once nobody else
        holds it (a copy in flight holds it, see `copy`)."""
        nbytes = storage.numel()
        with self._lock:
            if self.budget is not None and self.in_use + nbytes > self.budget:
                raise BudgetExceededError("device", self.budget, self.in_use, nbytes, what, parts=self.parts())
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
        return DeviceBuffer(storage)

    @contextlib.contextmanager
    def out_of_memory(self, nbytes: int, what: str) -> Iterator[None]:
        """Around a device allocation within the budget: CUDA's out-of-memory becomes DeviceOutOfMemoryError,
        naming the budget, what the tiers hold and what torch holds (what no budget counts took the room)."""
        try:
            yield
        except torch.cuda.OutOfMemoryError as exc:
            raise DeviceOutOfMemoryError(what, nbytes, self.budget, self.in_use,
                                         torch.cuda.memory_reserved(self.device),
                                         torch.cuda.memory_allocated(self.device), self.parts()) from exc

    def reserve(self, nbytes: int, what: str, part: str) -> None:
        """Count bytes the caller allocates itself, as `part`; raises BudgetExceededError past the budget."""
        with self._lock:
            if self.budget is not None and self.in_use + nbytes > self.budget:
                raise BudgetExceededError("device", self.budget, self.in_use, nbytes, what, parts=self.parts())
            self.in_use += nbytes
            self.reserved[part] = self.reserved.get(part, 0) + nbytes
            self.peak = max(self.peak, self.in_use)

    def unreserve(self, nbytes: int, part: str) -> None:
        with self._lock:
            self.in_use -= nbytes
            self.reserved[part] -= nbytes

    def parts(self) -> dict[str, int]:
        """What holds the budget now: the segments' buffers, then each reserved part."""
        return {"segments": self.in_use - sum(self.reserved.values()), **self.reserved}

    def free(self, buffer: DeviceBuffer | HostBuffer) -> None:
        size = buffer.capacity
        buffer.release()
        with self._lock:
            self.in_use -= size

    def lend(self, nbytes: int, what: str) -> HostBuffer | None:
        """Memory for `nbytes` the caller counted with `reserve`: without CUDA a buffer from the pool (a step
        reuses its pages instead of faulting in fresh ones; give it back with `release()` once no copy uses it,
        then `unreserve`); with CUDA None, the caller allocates (the caching allocator reuses device memory)."""
        return self.pool.acquire(nbytes, what) if self.pool is not None else None

    def mark(self) -> object:
        """The point the caller's compute has reached, for a copy submitted later or from another thread
        (`copy(after=...)`) to run behind; take it on the thread that queued that compute."""
        return self._stream.mark()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, handle: Handle | None = None, *,
             after: object = None) -> CopyEvent:
        """Copy `src` into `dst` (host<->device) on the copy stream, behind the compute the calling thread's
        current stream has queued (or behind `after`, a `mark()`); returns the copy's event, and completes
        `handle`, on the completion thread, once the bytes have landed. Who passes the tensors keeps them: `dst`
        is not read, `src` not written, and neither reused, handed over or freed until the copy has ended
        (a segment stays in its move until `handle` is done; a pinned one stays pinned)."""
        with self._submit_lock:  # the completion thread waits in the order the copies run
            event = self._stream.submit(dst, src, after)
            if handle is not None:
                self._completer.submit(_complete, event, handle)
        return event

    def trim(self) -> None:
        """Give the memory freed buffers keep cached back to the system (the pool's without CUDA, the caching
        allocator's with): after a rehome to the host, so another user of the accelerator can have it."""
        if self.pool is not None:
            self.pool.trim()
        elif self.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Return once every copy has run and its handle is done."""
        self._stream.close()
        self._completer.shutdown(wait=True)


def _complete(event: CopyEvent, handle: Handle) -> None:
    error = None
    try:
        event.synchronize()
    except BaseException as exc:  # surfaced through the handle
        error = exc
    handle.part_done(error)


def _indexed(device: torch.device) -> torch.device:
    """A CUDA device with its index (the current device where none is given): streams, events and budgets
    belong to one GPU."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
