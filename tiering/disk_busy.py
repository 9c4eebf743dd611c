"""How long the disks under the nvme tier were busy, by the kernel's own count: each block device's io_ticks
(/sys/dev/block/<major>:<minor>/stat, the milliseconds it had a request in flight). The yardstick for "the disk
never waits for us": the I/O lanes' intervals (timeline.py) also count a transfer's time queued in our engine and
its checksum, so they call the disk busier than it is (bench/RESULTS.md, session 46: 4.24 s against the device's
3.84 s in a 4.95 s step). Linux block devices only: elsewhere (tmpfs, overlay, another OS) nothing is known."""
from __future__ import annotations

import os
from typing import Iterable


def _stat_file(path: str) -> str | None:
    """The stat file of the block device holding `path`, or None where it has none."""
    try:
        device = os.stat(path).st_dev
    except OSError:
        return None
    stat = f"/sys/dev/block/{os.major(device)}:{os.minor(device)}/stat"
    return stat if os.path.exists(stat) else None


class DiskBusy:
    """The block devices holding `paths`; `read()` their busy seconds so far, `busiest(before, after)` the most any
    of them was busy between two reads."""

    def __init__(self, paths: Iterable[str]):
        self.files = sorted({f for f in map(_stat_file, paths) if f is not None})

    def read(self) -> tuple[float, ...] | None:
        """Each device's busy seconds since boot (io_ticks, the 10th field); None where no device is known."""
        if not self.files:
            return None
        try:
            ticks = []
            for name in self.files:
                with open(name) as f:
                    ticks.append(int(f.read().split()[9]) / 1000)
            return tuple(ticks)
        except (OSError, IndexError, ValueError):
            return None

    @staticmethod
    def busiest(before: tuple[float, ...] | None, after: tuple[float, ...] | None) -> float | None:
        if before is None or after is None:
            return None
        return max(b - a for a, b in zip(before, after))
