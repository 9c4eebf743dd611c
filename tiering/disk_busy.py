"""How long the disks under the nvme tier were busy, by the kernel's own count: each block device's io_ticks
(the 10th field of its sysfs `stat`, the milliseconds it had a request in flight). The yardstick for "the disk
never waits for us": the I/O lanes' intervals (timeline.py) also count a transfer's time queued in our engine and
its checksum, so they call the disk busier than it is (bench/RESULTS.md, session 46: 4.24 s against the device's
3.84 s in a 4.95 s step). A partition's path is counted on its whole disk (the other partitions share the device's
time). Nothing is known (None) off Linux block devices (tmpfs, overlay, another OS) and where the disk keeps no
counts (`queue/iostats` 0: they would stay still and read as idle)."""
from __future__ import annotations

import os
from typing import Iterable

WRAP = 1 << 32
"""io_ticks is an unsigned 32-bit count of milliseconds: it wraps after ~49.7 days busy."""


def _stat_file(path: str, sysfs: str) -> str | None:
    """The stat file of the whole disk holding `path`, or None where there is none that counts."""
    try:
        device = os.stat(path).st_dev
        disk = os.path.realpath(os.path.join(sysfs, "dev", "block", f"{os.major(device)}:{os.minor(device)}"))
        if os.path.exists(os.path.join(disk, "partition")):
            disk = os.path.dirname(disk)
        with open(os.path.join(disk, "queue", "iostats")) as f:
            counted = f.read().strip() == "1"
    except OSError:
        return None
    stat = os.path.join(disk, "stat")
    return stat if counted and os.path.exists(stat) else None


class DiskBusy:
    """The disks holding `paths`; `read()` their io_ticks now, `busiest(before, after)` the most seconds any of them
    was busy between two reads. `sysfs`: where sysfs is mounted."""

    def __init__(self, paths: Iterable[str], sysfs: str = "/sys"):
        self.files = sorted({f for f in (_stat_file(p, sysfs) for p in paths) if f is not None})

    def read(self) -> tuple[int, ...] | None:
        """Each disk's io_ticks (milliseconds, wrapping at 2^32); None where no disk is known."""
        if not self.files:
            return None
        try:
            ticks = []
            for name in self.files:
                with open(name) as f:
                    ticks.append(int(f.read().split()[9]))
            return tuple(ticks)
        except (OSError, IndexError, ValueError):
            return None

    @staticmethod
    def busiest(before: tuple[int, ...] | None, after: tuple[int, ...] | None) -> float | None:
        if before is None or after is None:
            return None
        return max((b - a) % WRAP for a, b in zip(before, after)) / 1000
