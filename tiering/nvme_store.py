"""NvmeStore: the nvme tier's bytes, in one preallocated file per directory of the user's nvme_path (one
directory per SSD), carved into 4 KiB-aligned extents and read or written asynchronously, each file through
its own I/O engine."""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch

from .aio_config import AioConfig
from .aligned import ALIGNMENT, align_up
from .errors import BudgetExceededError, StoreFullError, TieringConfigError
from .extents import Extent
from .handle import Handle
from .stale import StaleReport
from .store_file import StoreFile

RESERVE_SHARE = 0.05
RESERVE_MAX = 2 << 30
"""What `spare_bytes` leaves free on a filesystem: 5% of it, at most 2 GiB."""


@dataclass(frozen=True, kw_only=True)
class NvmeStoreConfig:
    nvme_path: str | os.PathLike | tuple[str | os.PathLike, ...]
    """Directory on a local SSD, or a list of directories, one per SSD (kept as a tuple): the store creates
    one file in each, with its own engine and queue, and places every segment whole in one of them (see
    NvmeStore). Each must exist and be writable; the store removes only its own files when closed."""

    budget: int | None = None
    """Hard cap on the size of the store's files together, in bytes; None: as much as the filesystems give."""

    grow_step: int = 256 << 20
    """The most a file grows (fallocate) by at once when no free extent fits a request: by its own size (so from
    the first request's need it doubles) up to this, or by what the request needs where that is more; on a disk
    with less left, by just what the request needs. A small state gets a small file."""

    aio: AioConfig = field(default_factory=AioConfig)
    """I/O engine settings, for each file's engine."""

    create: bool = False
    """Create a missing directory (and its parents) when the store opens, as DeepSpeed creates its swap folder under
    nvme_path; False: a missing directory is NvmePathError (a typo would otherwise put the store on another disk)."""

    def __post_init__(self) -> None:
        if isinstance(self.nvme_path, list):
            object.__setattr__(self, "nvme_path", tuple(self.nvme_path))
        paths = self.nvme_path if isinstance(self.nvme_path, tuple) else (self.nvme_path,)
        if not paths or not all(isinstance(p, (str, os.PathLike)) and os.fspath(p) for p in paths):
            raise TieringConfigError("nvme_path", self.nvme_path, "a directory path, or a non-empty list of them")
        directories = self.directories
        for i, directory in enumerate(directories):
            if directory in directories[:i]:
                raise TieringConfigError("nvme_path", self.nvme_path,
                                         f"names the directory {directory!r} twice: each holds one file of the store")
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget < ALIGNMENT):
            raise TieringConfigError("nvme budget", self.budget, f"None or an integer >= {ALIGNMENT}")
        if not isinstance(self.grow_step, int) or self.grow_step <= 0 or self.grow_step % ALIGNMENT:
            raise TieringConfigError("grow_step", self.grow_step, f"a positive multiple of {ALIGNMENT}")

    @property
    def directories(self) -> tuple[str, ...]:
        """Every directory of nvme_path, absolute, in the order given."""
        paths = self.nvme_path if isinstance(self.nvme_path, tuple) else (self.nvme_path,)
        return tuple(os.path.abspath(os.fspath(p)) for p in paths)


class NvmeStore:
    """Extents in one StoreFile per directory of nvme_path, each file with its own engine, queue and lock.

    Every extent lies whole in one file: the least-used one (ties: the earlier directory), so segments
    allocated one after another alternate between the files, and so do the reads that bring them back in
    the same order. Why not cut every segment across all files instead? The swap manager keeps several
    segments of 16-64 MB in flight (prefetch along the trace, eviction write-back, the optimizer's
    read-ahead), which already keeps every device busy, so N directories on N SSDs give ~N times the
    bandwidth either way; whole extents keep each transfer one request stream on one file, need no split
    handles or stripe arithmetic, and a checksum or I/O error names the one file holding the bytes
    (`path_of`). The cost: a lone blocking transfer moves at one device's speed.

    A file that cannot take a segment (its disk is full, or growing it would pass the budget, which covers
    all files together) passes it to the next; only when none can is the error raised, the one of the file
    tried first. With one directory the store is that one file: same name, same errors as ever.
    """

    def __init__(self, config: NvmeStoreConfig):
        self.config = config
        files: list[StoreFile] = []
        try:
            for directory in config.directories:
                files.append(StoreFile(directory, config.aio, config.grow_step, create=config.create))
        except BaseException:
            for file in files:
                file.close()
            raise
        self.files = tuple(files)
        """One per directory of nvme_path, in its order; `Extent.file` indexes this."""
        self.path = ", ".join(f.path for f in files)
        """The store's file; with several directories their paths joined by ', ' (for messages: `path_of`
        names the one file an extent lies in)."""
        self.direct_io = all(f.direct_io for f in files)
        self.engine_name = "+".join(dict.fromkeys(f.engine_name for f in files))
        self.engine_reason = "; ".join(dict.fromkeys(f.engine_reason for f in files))
        self.stale = StaleReport(", ".join(f.stale.directory for f in files),
                                 [s for f in files for s in f.stale.removed], [s for f in files for s in f.stale.kept])
        """What the files' sweeps found in their directories (tiering/stale.py), all of it in one report."""
        self._lock = threading.Lock()

    # -- space -------------------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return sum(f.capacity for f in self.files)

    @property
    def used_bytes(self) -> int:
        return sum(f.used_bytes for f in self.files)

    def spare_bytes(self) -> int:
        """Bytes the store can still take while leaving each filesystem it writes to a reserve (RESERVE_SHARE of
        the filesystem, at most RESERVE_MAX): its files' free ranges and their filesystems' free space. For what
        may be refused (a kept copy-on-write extent), so that an optional copy never fills the disk."""
        spare, seen = 0, set()
        for file in self.files:
            spare += file.capacity - file.used_bytes
            stat = os.statvfs(os.path.dirname(file.path))
            if stat.f_fsid in seen:
                continue
            seen.add(stat.f_fsid)
            reserve = min(RESERVE_MAX, int(RESERVE_SHARE * stat.f_blocks * stat.f_frsize))
            spare += max(0, stat.f_bavail * stat.f_frsize - reserve)
        return spare

    def allocate(self, nbytes: int, what: str = "") -> Extent:
        """An extent of `nbytes` rounded up to 4 KiB in the least-used file that can hold it, growing that
        file if no free range fits.

        Raises BudgetExceededError (tier 'nvme') past the store's budget and StoreFullError when the
        filesystem cannot give the bytes (ENOSPC, EFBIG), each only when no file can take the extent; the
        store is unchanged after either.
        """
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        budget = self.config.budget
        with self._lock:  # one allocation at a time: the budget covers the files together
            refused: BudgetExceededError | StoreFullError | None = None
            for index in sorted(range(len(self.files)), key=lambda i: self.files[i].used_bytes):
                file = self.files[index]
                try:
                    extent = file.allocate(nbytes, None if budget is None else budget - self.capacity)
                except StoreFullError as exc:
                    refused = refused or exc
                    continue
                if extent is not None:
                    return extent._replace(file=index)
                refused = refused or BudgetExceededError("nvme", budget, self.used_bytes, align_up(max(nbytes, 1)),
                                                         what, file.path)
            raise refused

    def free(self, extent: Extent) -> None:
        self._file(extent).free(extent)

    # -- I/O ---------------------------------------------------------------------------------------------

    def write(self, extent: Extent, buffer: torch.Tensor, nbytes: int | None = None) -> Handle:
        """Start writing the first `nbytes` (default: the extent's length) of `buffer` to `extent`.

        The length moved is `nbytes` rounded up to 4 KiB, so `buffer` must hold that many bytes. The handle
        keeps `buffer` alive until done; the caller must not change it before then. A write is done only
        when every byte reached the file; otherwise `wait()` raises IOFailedError naming path and offset.
        """
        return self._file(extent).submit("write", extent, buffer, nbytes)

    def read(self, extent: Extent, buffer: torch.Tensor, nbytes: int | None = None) -> Handle:
        """Start reading `nbytes` (rounded up to 4 KiB) of `extent` into `buffer`; see `write`."""
        return self._file(extent).submit("read", extent, buffer, nbytes)

    def path_of(self, extent: Extent) -> str:
        """The file `extent` lies in."""
        return self._file(extent).path

    def _file(self, extent: Extent) -> StoreFile:
        if not 0 <= extent.file < len(self.files):
            raise ValueError(f"{extent} names file {extent.file}; this store has {len(self.files)}: {self.path}")
        return self.files[extent.file]

    def sync(self) -> None:
        """fsync the files: what was written survives a power loss (O_DIRECT alone skips only the page cache)."""
        for file in self.files:
            file.sync()

    # -- life --------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for in-flight I/O, then remove the store's files. Idempotent."""
        for file in self.files:
            file.close()

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"NvmeStore({self.path!r}, engine={self.engine_name}, direct_io={self.direct_io}, "
                f"capacity={self.capacity}, used={self.used_bytes})")
