"""NvmeStore: one preallocated file per store under the user's nvme_path, carved into 4 KiB-aligned extents
and read or written asynchronously through an I/O engine."""
from __future__ import annotations

import errno
import fcntl
import os
import secrets
import threading
from dataclasses import dataclass, field

import torch

from .aio_config import AioConfig
from .aligned import ALIGNMENT, align_up, check_io_buffer
from .engines import choose_engine
from .errors import (
    BudgetExceededError,
    NvmePathError,
    StoreFullError,
    StoreRangeError,
    TieringConfigError,
)
from .extents import Extent, ExtentAllocator
from .handle import Handle
from .stale import sweep as sweep_stale, this_host

GiB = 1 << 30
SWAP_SUFFIX = ".swap"
SWAP_PREFIX = "zt-"


@dataclass(frozen=True, kw_only=True)
class NvmeStoreConfig:
    nvme_path: str
    """Directory on a local SSD. Must exist and be writable; the store creates one file in it and removes
    only that file when closed."""

    budget: int | None = None
    """Hard cap on the store file's size in bytes; None: as much as the filesystem gives."""

    grow_step: int = 256 << 20
    """The file grows (fallocate) by at least this many bytes when no free extent fits a request."""

    aio: AioConfig = field(default_factory=AioConfig)
    """I/O engine settings."""

    def __post_init__(self) -> None:
        if not isinstance(self.nvme_path, (str, os.PathLike)) or not str(self.nvme_path):
            raise TieringConfigError("nvme_path", self.nvme_path, "a directory path")
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget < ALIGNMENT):
            raise TieringConfigError("nvme budget", self.budget, f"None or an integer >= {ALIGNMENT}")
        if not isinstance(self.grow_step, int) or self.grow_step <= 0 or self.grow_step % ALIGNMENT:
            raise TieringConfigError("grow_step", self.grow_step, f"a positive multiple of {ALIGNMENT}")


def swap_file_name() -> str:
    """`zt-<host>-<pid>-<random>.swap`: unique per store, and says which process made it."""
    return f"{SWAP_PREFIX}{this_host()}-{os.getpid()}-{secrets.token_hex(4)}{SWAP_SUFFIX}"


class NvmeStore:
    """Extents of one file, moved to and from aligned host buffers by an I/O engine.

    Two stores on the same nvme_path (two ranks, two processes) use two files created with O_EXCL, and each
    holds an exclusive flock on its own file while open, so a leftover file whose lock can be taken is
    provably stale. `close()` removes the store's own file and nothing else.
    """

    def __init__(self, config: NvmeStoreConfig):
        self.config = config
        directory = os.path.abspath(os.fspath(config.nvme_path))
        if not os.path.isdir(directory):
            reason = "does not exist" if not os.path.exists(directory) else "is not a directory"
            raise NvmePathError(directory, reason)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise NvmePathError(directory, "is not writable by this process")
        self.path = os.path.join(directory, swap_file_name())
        self._fd, self.direct_io, detail = self._open(self.path)
        self._closed = False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._engine, self.engine_reason = choose_engine(config.aio, self.path, self.direct_io, detail)
        except BaseException:
            self._remove_file()
            raise
        self.engine_name = self._engine.name
        self._extents = ExtentAllocator()
        self._lock = threading.Lock()
        self.stale = sweep_stale(directory, self.path)
        """Swap files of dead processes found in nvme_path as this store opened (its own file locked first):
        the provably stale ones removed, all reported with a StaleSwapFileWarning (tiering/stale.py)."""

    @staticmethod
    def _open(path: str) -> tuple[int, bool, str]:
        """Create the file with O_DIRECT if the filesystem takes it; say why not otherwise."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True, "O_DIRECT"
        except PermissionError as exc:
            raise NvmePathError(os.path.dirname(path), f"cannot create a file: {exc.strerror}") from exc
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise NvmePathError(os.path.dirname(path), f"cannot create a file: {exc.strerror}") from exc
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            detail = "the filesystem refuses O_DIRECT (EINVAL)"
        return os.open(path, flags, 0o600), False, detail

    # -- space -------------------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._extents.capacity

    @property
    def used_bytes(self) -> int:
        return self._extents.used_bytes

    def allocate(self, nbytes: int, what: str = "") -> Extent:
        """An extent of `nbytes` rounded up to 4 KiB, growing the file if no free range fits.

        Raises BudgetExceededError (tier 'nvme') past the store's budget and StoreFullError when the
        filesystem cannot give the bytes (ENOSPC, EFBIG); the store is unchanged after either.
        """
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        with self._lock:
            self._check_open()
            extent = self._extents.allocate(nbytes)
            if extent is None:
                self._grow_for(align_up(max(nbytes, 1)), what)
                extent = self._extents.allocate(nbytes)
            return extent

    def free(self, extent: Extent) -> None:
        with self._lock:
            self._extents.free(extent)

    def _grow_for(self, length: int, what: str) -> None:
        old = self._extents.capacity
        need = length - self._extents.tail_free()
        budget = self.config.budget
        grow = max(need, self.config.grow_step)
        if budget is not None:
            if old + need > budget:
                raise BudgetExceededError("nvme", budget, self._extents.used_bytes, length, what, self.path)
            grow = min(grow, budget - old)
        try:
            os.posix_fallocate(self._fd, old, grow)
        except OSError as exc:
            if exc.errno == errno.EOPNOTSUPP:  # no fallocate here (ramfs, some network fs): sparse growth
                os.ftruncate(self._fd, old + grow)
            else:
                os.ftruncate(self._fd, old)  # give back a partial allocation
                raise StoreFullError(self.path, grow, old, exc) from exc
        self._extents.grow(old + grow)

    # -- I/O ---------------------------------------------------------------------------------------------

    def write(self, extent: Extent, buffer: torch.Tensor, nbytes: int | None = None) -> Handle:
        """Start writing the first `nbytes` (default: the extent's length) of `buffer` to `extent`.

        The length moved is `nbytes` rounded up to 4 KiB, so `buffer` must hold that many bytes. The handle
        keeps `buffer` alive until done; the caller must not change it before then. A write is done only
        when every byte reached the file; otherwise `wait()` raises IOFailedError naming path and offset.
        """
        return self._submit("write", extent, buffer, nbytes)

    def read(self, extent: Extent, buffer: torch.Tensor, nbytes: int | None = None) -> Handle:
        """Start reading `nbytes` (rounded up to 4 KiB) of `extent` into `buffer`; see `write`."""
        return self._submit("read", extent, buffer, nbytes)

    def _submit(self, op: str, extent: Extent, buffer: torch.Tensor, nbytes: int | None) -> Handle:
        self._check_open()
        nbytes = extent.length if nbytes is None else nbytes
        length = align_up(nbytes) if nbytes else 0
        if extent.offset < 0 or extent.offset % ALIGNMENT or extent.length % ALIGNMENT:
            raise StoreRangeError(self.path, extent.offset, extent.length, self.capacity, f"{op} of an unaligned or negative extent")
        if nbytes < 0 or length > extent.length:
            raise StoreRangeError(self.path, extent.offset, nbytes, extent.length, f"{op} past its extent")
        if extent.offset + length > self.capacity:
            raise StoreRangeError(self.path, extent.offset, length, self.capacity, f"{op} past the end of the store")
        check_io_buffer(buffer, length, f"{op} of {nbytes} bytes at offset {extent.offset} in {self.path!r}")
        handle = Handle(self._engine.blocks(length), label=f"{op} {self.path}@{extent.offset}+{length}", keepalive=buffer)
        if length:
            self._engine.submit(op, self._fd, self.path, buffer.data_ptr(), length, extent.offset, handle)
        return handle

    def sync(self) -> None:
        """fsync the file: what was written survives a power loss (O_DIRECT alone skips only the page cache)."""
        self._check_open()
        os.fsync(self._fd)

    # -- life --------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"store {self.path!r} is closed")

    def _remove_file(self) -> None:
        """Unlink our file, if the name still points at the file we created."""
        try:
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)

    def close(self) -> None:
        """Wait for in-flight I/O, then remove the store's file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._engine.close()
        self._remove_file()

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"NvmeStore({self.path!r}, engine={self.engine_name}, direct_io={self.direct_io}, "
                f"capacity={self.capacity}, used={self.used_bytes})")
