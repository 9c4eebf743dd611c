"""The nvme device's busy time by the kernel's count (tiering/disk_busy.py): what bench/stream.py's idle column and
the main job's "disk busy" read."""
from __future__ import annotations

import os
import time

import pytest

from tiering.aligned import aligned_empty
from tiering.disk_busy import DiskBusy


def test_a_path_on_no_block_device_knows_nothing(tmp_path):
    for paths in ([str(tmp_path / "missing")], ["/proc"], []):
        disk = DiskBusy(paths)
        assert disk.files == [] and disk.read() is None
        assert DiskBusy.busiest(disk.read(), disk.read()) is None


def test_the_count_wrapping_between_two_reads_is_still_the_time_between_them():
    assert DiskBusy.busiest((2**32 - 5, 100), (3, 100)) == 0.008  # io_ticks: 32-bit milliseconds


def test_direct_writes_make_the_device_busy_for_no_longer_than_they_took(tmp_path):
    disk = DiskBusy([str(tmp_path)])
    if not disk.files:
        pytest.skip(f"{tmp_path} is on no disk whose time the kernel counts (tmpfs, overlay, iostats off)")
    buffer = aligned_empty(8 << 20).fill_(7)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0))
    try:
        before, start = disk.read(), time.perf_counter()
        for i in range(8):
            os.pwrite(fd, memoryview(buffer.numpy()), i * buffer.numel())
        os.fsync(fd)
        took, after = time.perf_counter() - start, disk.read()
    finally:
        os.close(fd)
    busy = DiskBusy.busiest(before, after)
    assert 0 < busy <= took + 0.05  # the device's own clock (ms ticks): never longer than the writes took
