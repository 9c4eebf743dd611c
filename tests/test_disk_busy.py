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


def fake_sysfs(root, path, *, partition: bool, iostats: str) -> str:
    """A sysfs under `root` whose block device for `path` is a disk `sda` (or its partition `sda1`): the stat file of
    the disk says 250 ms busy, the partition's 40."""
    device = os.stat(path).st_dev
    disk = root / "devices" / "sda"
    (disk / "queue").mkdir(parents=True)
    (disk / "queue" / "iostats").write_text(iostats + "\n")
    (disk / "stat").write_text("1 0 8 5 2 0 16 7 0 250 12 0 0 0 0\n")
    target = disk
    if partition:
        target = disk / "sda1"
        target.mkdir()
        (target / "partition").write_text("1\n")
        (target / "stat").write_text("1 0 8 5 2 0 16 7 0 40 12 0 0 0 0\n")
    (root / "dev" / "block").mkdir(parents=True)
    (root / "dev" / "block" / f"{os.major(device)}:{os.minor(device)}").symlink_to(target)
    return str(root)


@pytest.mark.parametrize("partition", [False, True])
def test_a_path_on_a_partition_is_counted_on_its_whole_disk(partition, tmp_path):
    disk = DiskBusy([str(tmp_path)], sysfs=fake_sysfs(tmp_path / "sys", tmp_path, partition=partition, iostats="1"))
    assert disk.files == [str(tmp_path / "sys" / "devices" / "sda" / "stat")] and disk.read() == (250,)


def test_a_disk_that_keeps_no_counts_knows_nothing(tmp_path):
    """`queue/iostats` 0: its io_ticks stay still, and would read as idle."""
    disk = DiskBusy([str(tmp_path)], sysfs=fake_sysfs(tmp_path / "sys", tmp_path, partition=False, iostats="0"))
    assert disk.files == [] and disk.read() is None


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
