"""The device tier: accelerator memory under a hard budget, and the host<->device copy path.

Without CUDA the device tier is host memory counted against the device budget (every code path runs and is
tested on CPU); its buffers come from a pool so steps reuse memory instead of faulting in fresh pages.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from .aligned import align_up
from .errors import BudgetExceededError
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


class DeviceTier:
    def __init__(self, budget: int | None, device: torch.device | None = None):
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.budget = budget
        self._lock = threading.Lock()
        self.in_use = 0
        self.peak = 0
        if self.device.type == "cpu":
            self._pool = HostBufferPool(HostPoolConfig(budget=budget if budget is not None else 1 << 62, pin=False))
            self._copy_stream = None
        else:
            self._pool = None
            # The one stream for host<->device copies: moves overlap the compute stream's kernels.
            self._copy_stream = torch.cuda.Stream(self.device)
        # One mover thread runs copies in submission order and completes their handles, so every handle in
        # tiering is completed by a thread and callers never poll streams.
        self._mover = ThreadPoolExecutor(1, thread_name_prefix="tiering-mover")

    def free_bytes(self) -> int | None:
        return None if self.budget is None else self.budget - self.in_use

    def charge(self, nbytes: int) -> int:
        """Bytes a copy of `nbytes` takes from the budget: the CPU stand-in's pool hands out whole 4 KiB pages,
        and the budget counts what is really held (else its pool refuses what the budget allowed)."""
        return align_up(max(nbytes, 1)) if self._pool is not None else max(nbytes, 1)

    def allocate(self, nbytes: int, what: str) -> DeviceBuffer | HostBuffer:
        """Device storage for `nbytes`; raises BudgetExceededError past the budget (callers evict first)."""
        with self._lock:
            if self.budget is not None and self.in_use + self.charge(nbytes) > self.budget:
                raise BudgetExceededError("device", self.budget, self.in_use, self.charge(nbytes), what)
            if self._pool is not None:
                buffer = self._pool.acquire(nbytes, what)  # within its budget: in_use is the pool's in_use
            else:
                buffer = DeviceBuffer(torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device))
            self.in_use += buffer.capacity
            self.peak = max(self.peak, self.in_use)
        return buffer

    def reserve(self, nbytes: int, what: str) -> None:
        """Count bytes the caller allocates itself; raises BudgetExceededError past the budget."""
        with self._lock:
            if self.budget is not None and self.in_use + nbytes > self.budget:
                raise BudgetExceededError("device", self.budget, self.in_use, nbytes, what)
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            self.in_use -= nbytes

    def free(self, buffer: DeviceBuffer | HostBuffer) -> None:
        size = buffer.capacity
        buffer.release()
        with self._lock:
            self.in_use -= size

    def copy(self, dst: torch.Tensor, src: torch.Tensor, handle: Handle) -> None:
        """Copy `src` into `dst` (host<->device) on the mover; completes `handle` when the bytes have landed."""
        self._mover.submit(self._copy, dst, src, handle)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, handle: Handle) -> None:
        error = None
        try:
            if self._copy_stream is None:
                dst.copy_(src)
            else:
                # Wait for the compute stream's writes to `src` (eviction) or reads of `dst`'s old bytes.
                self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._copy_stream):
                    dst.copy_(src, non_blocking=True)  # pinned host buffers make this asynchronous
                    done = torch.cuda.Event()
                    done.record(self._copy_stream)
                done.synchronize()
        except BaseException as exc:  # surfaced through the handle
            error = exc
        handle.part_done(error)

    def close(self) -> None:
        self._mover.shutdown(wait=True)
