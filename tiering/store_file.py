"""StoreFile: one preallocated file in one nvme directory, carved into 4 KiB-aligned extents and read or
written asynchronously through its own I/O engine. NvmeStore keeps one per directory of its nvme_path."""
from __future__ import annotations

import errno
import fcntl
import os
import secrets
import threading
import weakref

import torch

from .aio_config import AioConfig
from .aligned import ALIGNMENT, align_up, check_io_buffer
from .engines import choose_engine
from .errors import NvmePathError, StoreFullError, StoreRangeError
from .extents import Extent, ExtentAllocator
from .handle import Handle
from .stale import sweep as sweep_stale, this_host

SWAP_SUFFIX = ".swap"
SWAP_PREFIX = "zt-"
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""What a failed growth says when the filesystem (or a quota, or the file size limit) lacks the bytes."""


def swap_file_name() -> str:
    """`zt-<host>-<pid>-<random>.swap`: unique per store file, and says which process made it."""
    return f"{SWAP_PREFIX}{this_host()}-{os.getpid()}-{secrets.token_hex(4)}{SWAP_SUFFIX}"


def _unlink_if_ours(path: str, inode: int) -> None:
    """Unlink `path` if it still names the file (`inode`) a store created. Its descriptor is left open: an
    engine's I/O may still be using it, and its number must not name another file meanwhile."""
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass


class StoreFile:
    """Extents of one file, moved to and from aligned host buffers by the file's own engine (its own queue).

    Two stores on the same directory (two ranks, two processes) use two files created with O_EXCL, and each
    holds an exclusive flock on its own file while open, so a leftover file whose lock can be taken is
    provably stale. `close()` removes this file and nothing else.
    """

    def __init__(self, directory: str, aio: AioConfig, grow_step: int, *, create: bool = False):
        directory = os.path.abspath(os.fspath(directory))
        if create and not os.path.exists(directory):
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as error:
                raise NvmePathError(directory, f"does not exist and cannot be created ({error.strerror})") from error
        if not os.path.isdir(directory):
            reason = "does not exist" if not os.path.exists(directory) else "is not a directory"
            raise NvmePathError(directory, reason)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise NvmePathError(directory, "is not writable by this process")
        self._grow_step = grow_step
        self.path = os.path.join(directory, swap_file_name())
        self._fd, self.direct_io, detail = self._open(self.path)
        self._closed = False
        try:
            # Blocking: another store's sweep of stale files may hold this new file's lock for a moment (it
            # then leaves the file alone: this process runs); nobody else has reason to.
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            self._engine, self.engine_reason = choose_engine(aio, self.path, self.direct_io, detail)
        except BaseException:
            self._remove_file()
            raise
        self.engine_name = self._engine.name
        self._at_exit = weakref.finalize(self, _unlink_if_ours, self.path, os.fstat(self._fd).st_ino)
        """Removes the file when the process ends normally (or the store is collected) without `close()`; a
        crash leaves it to the next store's sweep of stale files."""
        self._extents = ExtentAllocator()
        self._lock = threading.Lock()
        self.stale = sweep_stale(directory, self.path)
        """Swap files of dead processes found in the directory as this file opened (itself locked first):
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

    def allocate(self, nbytes: int, room: int | None) -> Extent | None:
        """An extent of `nbytes` rounded up to 4 KiB, growing the file if no free range fits; None when that
        would grow it by more than `room` bytes (what the store's budget leaves; None: no budget).

        Raises StoreFullError when the filesystem cannot give the bytes (ENOSPC, EFBIG); the file is
        unchanged after that or a None.
        """
        with self._lock:
            self._check_open()
            extent = self._extents.allocate(nbytes)
            if extent is None:
                need = align_up(max(nbytes, 1)) - self._extents.tail_free()
                if room is not None and need > room:
                    return None
                # By its own size (from the first request's need, doubling) up to grow_step at a time: a small
                # state gets a small file, a large one few fallocates.
                grow = max(need, min(self._grow_step, self._extents.capacity))
                self._grow(grow if room is None else min(grow, room), need)
                extent = self._extents.allocate(nbytes)
            return extent

    def free(self, extent: Extent) -> None:
        with self._lock:
            self._extents.free(extent)

    def _grow(self, grow: int, need: int) -> None:
        """Grow the file by `grow` bytes or, where the filesystem has no room for those, by just the `need` of
        the request (a disk nearly full still holds what fits)."""
        old = self._extents.capacity
        for size in dict.fromkeys((grow, need)):
            try:
                os.posix_fallocate(self._fd, old, size)
                break
            except OSError as exc:
                if exc.errno == errno.EOPNOTSUPP:  # no fallocate here (ramfs, some network fs): sparse growth
                    os.ftruncate(self._fd, old + size)
                    break
                os.ftruncate(self._fd, old)  # give back a partial allocation
                if size == need or exc.errno not in NO_ROOM:
                    raise StoreFullError(self.path, size, old, exc) from exc
        self._extents.grow(old + size)

    # -- I/O ---------------------------------------------------------------------------------------------

    def submit(self, op: str, extent: Extent, buffer: torch.Tensor, nbytes: int | None) -> Handle:
        """Start moving `nbytes` (rounded up to 4 KiB) between `extent` and `buffer`; see NvmeStore.write."""
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
        self._check_open()
        os.fsync(self._fd)

    # -- life --------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"store {self.path!r} is closed")

    def _remove_file(self) -> None:
        """Unlink our file, if the name still points at the file we created."""
        at_exit = getattr(self, "_at_exit", None)
        if at_exit is not None:
            at_exit.detach()
        _unlink_if_ours(self.path, os.fstat(self._fd).st_ino)
        os.close(self._fd)

    def close(self) -> None:
        """Wait for in-flight I/O, then remove the file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._engine.close()
        self._remove_file()
