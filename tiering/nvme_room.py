"""Will the state homed on nvme fit? Asked before any of it is written, so that a disk too small (or an nvme
budget too low) is one error naming the directory and the numbers, not a StoreFullError after the model was
built and half its state written. The answer follows the store's own placement: each segment whole in the
least-used file (ties: the earlier directory), 4 KiB-aligned."""
from __future__ import annotations

import os
from collections.abc import Iterable

from .aligned import align_up
from .errors import NvmeSpaceError
from .nvme_store import NvmeStore


def bytes_per_file(store: NvmeStore, sizes: Iterable[int]) -> list[int]:
    """Bytes each of the store's files will hold once segments of `sizes` (in registration order) are added to
    what it holds now."""
    used = [f.used_bytes for f in store.files]
    for nbytes in sizes:
        index = min(range(len(used)), key=lambda i: (used[i], i))
        used[index] += align_up(max(nbytes, 1))
    return used


def check_room(store: NvmeStore, sizes: Iterable[int]) -> None:
    """Raise NvmeSpaceError where the segments of `sizes` cannot fit: a filesystem with too little free space
    (beyond what the store's files on it already hold) for the directories on it, or the store's budget."""
    needed = bytes_per_file(store, sizes)
    budget = store.config.budget
    if budget is not None and sum(needed) > budget:
        raise NvmeSpaceError("zero_tiering.nvme_budget", sum(needed), budget, "the budget's {}")
    # Per filesystem (directories may share one): what its files must hold, and what it has for them: its free
    # space and the files' own bytes (reusable).
    shared: dict[int, tuple[list[str], list[int]]] = {}
    for file, need in zip(store.files, needed):
        directory = os.path.dirname(file.path)
        stat = os.statvfs(directory)
        directories, sums = shared.setdefault(stat.f_fsid, ([], [0, stat.f_bavail * stat.f_frsize]))
        directories.append(directory)
        sums[0] += need
        sums[1] += file.capacity
    for directories, (need, free) in shared.values():
        if need > free:
            raise NvmeSpaceError(f"nvme_path {', '.join(map(repr, directories))}", need, free,
                                 "the {} free there" if len(directories) == 1 else
                                 "the {} free on the filesystem they share")
