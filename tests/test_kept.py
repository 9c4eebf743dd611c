"""Kept copies (SwapManager.keep / commit / restore): a segment written speculatively gets back exactly the
bytes it held at `keep` on `restore`, keeps the new ones on `commit`, wherever its copies went meanwhile; on
nvme the kept copy is the old extent (copy on write: no byte moves to keep it), and a damaged one is a
checksum error at the read, never wrong bytes."""
from __future__ import annotations

import contextlib
import os
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering import (AioConfig, ChecksumMismatchError, IllegalTransitionError, NvmeStoreConfig, Residency, SwapConfig,
                     SwapManager)

from conftest import MOVE_TIMEOUT, PAGE  # noqa: F401  (make_manager: the fixture, from conftest)

N = PAGE // 4  # one page of fp32


def write(mgr, name: str, value: float, tier: str = "host") -> None:
    with mgr.held(name, tier, dirty=True) as view:
        view.fill_(value)


def read(mgr, name: str, tier: str = "host") -> torch.Tensor:
    with mgr.held(name, tier) as view:
        return view.clone()


def settle(mgr, name: str) -> None:
    seg = mgr.segments[name]
    if seg.move is not None:
        seg.move.wait(MOVE_TIMEOUT)


@contextlib.contextmanager
def manager(nvme: bool):
    """A swap manager of its own (hypothesis runs many examples in one test), on a fresh directory."""
    with tempfile.TemporaryDirectory() as path:
        store = NvmeStoreConfig(nvme_path=path, grow_step=4 * PAGE, aio=AioConfig(engine="threads")) if nvme else None
        mgr = SwapManager(SwapConfig(nvme=store, host_budget=64 * PAGE, prefetch_bytes=0))
        try:
            yield mgr
        finally:
            mgr.close()


@settings(max_examples=25, deadline=None)
@given(home=st.sampled_from(["nvme", "host"]), evicted_before=st.booleans(), evicted_after=st.booleans(),
       writes=st.integers(1, 3), undo=st.booleans())
def test_restore_gives_the_kept_bytes_and_commit_the_new_ones(home, evicted_before, evicted_after, writes, undo):
    with manager(home == "nvme") as mgr:
        check_round_trip(mgr, home, evicted_before, evicted_after, writes, undo)


def check_round_trip(mgr, home, evicted_before, evicted_after, writes, undo) -> None:
    mgr.register("s", dtype=torch.float32, shape=(N,), home=home, data=torch.full((N,), 1.0)).wait()
    write(mgr, "s", 2.0)  # the bytes to keep: dirty in host memory, or written home first
    if evicted_before and home == "nvme":
        mgr.evict("s").wait(MOVE_TIMEOUT)
    used = mgr.store.used_bytes if home == "nvme" else mgr.pool.in_use
    assert mgr.keep("s")
    for k in range(writes):
        write(mgr, "s", 3.0 + k)
        if evicted_after and home == "nvme":
            mgr.evict("s").wait(MOVE_TIMEOUT)  # the new bytes go to a fresh extent, not over the kept ones
    settle(mgr, "s")
    if undo:
        mgr.restore("s")
        assert torch.equal(read(mgr, "s"), torch.full((N,), 2.0))
    else:
        mgr.commit("s")
        assert torch.equal(read(mgr, "s"), torch.full((N,), 3.0 + writes - 1))
    settle(mgr, "s")
    if home == "nvme":
        mgr.evict("s").wait(MOVE_TIMEOUT)
        assert mgr.store.used_bytes == max(used, PAGE), "a kept extent outlived its commit or restore"
        assert torch.equal(read(mgr, "s"), torch.full((N,), 2.0 if undo else 3.0 + writes - 1))
    else:
        assert mgr.pool.in_use == used, "a kept buffer outlived its commit or restore"
    assert mgr.segments["s"].kept is None


def test_keeping_a_segment_whose_nvme_copy_is_current_moves_no_byte(make_manager):
    mgr = make_manager(engine="threads")
    mgr.register("s", dtype=torch.float32, shape=(N,), home="nvme", data=torch.full((N,), 1.0)).wait()
    moved = dict(mgr.stats.bytes_moved)
    in_use = mgr.pool.in_use
    assert mgr.keep("s")
    assert dict(mgr.stats.bytes_moved) == moved and mgr.pool.in_use == in_use
    assert mgr.segments["s"].state == Residency.NVME
    mgr.commit("s")
    # A clean copy on the device: the nvme copy is kept, not a second device buffer.
    assert torch.equal(read(mgr, "s", "device"), torch.full((N,), 1.0))
    on_device, moved = mgr.device_tier.in_use, dict(mgr.stats.bytes_moved)
    assert mgr.keep("s")
    assert mgr.device_tier.in_use == on_device and dict(mgr.stats.bytes_moved) == moved
    with mgr.held("s", "device", dirty=True) as view:
        view.fill_(2.0)
    mgr.restore("s")
    assert torch.equal(read(mgr, "s", "device"), torch.full((N,), 1.0))


def test_restoring_a_segment_not_written_since_its_keep_keeps_its_copies(make_manager):
    mgr = make_manager(engine="threads")
    mgr.register("s", dtype=torch.float32, shape=(N,), home="nvme", data=torch.full((N,), 1.0)).wait()
    assert torch.equal(read(mgr, "s", "device"), torch.full((N,), 1.0))
    used = mgr.store.used_bytes
    assert mgr.keep("s")
    assert torch.equal(read(mgr, "s", "device"), torch.full((N,), 1.0))  # read, never written
    mgr.restore("s")
    assert mgr.segments["s"].state == Residency.DEVICE, "a restore dropped copies holding the kept bytes"
    moved = dict(mgr.stats.bytes_moved)
    assert torch.equal(read(mgr, "s", "device"), torch.full((N,), 1.0))
    assert dict(mgr.stats.bytes_moved) == moved
    write(mgr, "s", 2.0, "device")  # the copy-on-write room was given back: a write-back may reuse the extent
    mgr.evict("s").wait(MOVE_TIMEOUT)
    mgr.evict("s").wait(MOVE_TIMEOUT)
    assert mgr.store.used_bytes == used and torch.equal(read(mgr, "s"), torch.full((N,), 2.0))


def test_a_damaged_kept_extent_is_a_checksum_error_at_the_read(make_manager, tmp_path):
    mgr = make_manager(engine="threads")
    mgr.register("s", dtype=torch.float32, shape=(N,), home="nvme", data=torch.full((N,), 1.0)).wait()
    kept_extent = mgr.segments["s"].extent
    assert mgr.keep("s")
    write(mgr, "s", 5.0)
    mgr.evict("s").wait(MOVE_TIMEOUT)
    assert mgr.segments["s"].extent != kept_extent
    path = mgr.store.path_of(kept_extent)
    with open(path, "r+b") as f:
        f.seek(kept_extent.offset + 100)
        f.write(b"\xff\xff\xff\xff")
        f.flush()
        os.fsync(f.fileno())
    mgr.restore("s")
    with pytest.raises(ChecksumMismatchError, match="'s'"):
        read(mgr, "s")


def test_no_room_keeps_nothing(make_manager):
    """A host copy needs free room in the host budget (nothing is evicted for it); a copy-on-write extent needs
    room in the nvme budget."""
    mgr = make_manager(host_budget=2 * PAGE)
    mgr.register("a", dtype=torch.float32, shape=(N,), home="host").wait()
    mgr.register("b", dtype=torch.float32, shape=(N,), home="host").wait()
    assert not mgr.keep("a")
    assert mgr.segments["a"].kept is None
    nvme = make_manager(engine="threads", nvme_budget=4 * PAGE)
    nvme.register("c", dtype=torch.float32, shape=(2 * N,), home="nvme").wait()
    nvme.register("d", dtype=torch.float32, shape=(N,), home="nvme").wait()
    assert not nvme.keep("c"), "a second copy of c (2 pages) does not fit the 4-page budget beside c and d"
    assert nvme.keep("d")
    # Extents are whole pages: two segments of 100 bytes take a page each, and so do their copies.
    small = make_manager(engine="threads", nvme_budget=3 * PAGE)
    for name in "ef":
        small.register(name, dtype=torch.uint8, shape=(100,), home="nvme",
                       data=torch.full((100,), 7, dtype=torch.uint8)).wait()
    assert small.keep("e") and not small.keep("f"), "one copy's page fits beside the two, not two"
    for name in "ef":
        view = small.acquire(name, "host")
        view.fill_(9)
        small.release(name, dirty=True)
        small.evict(name).wait(MOVE_TIMEOUT)  # "e" to a fresh page, "f" over its own
    small.restore("e")
    assert read(small, "e").tolist() == [7] * 100 and read(small, "f").tolist() == [9] * 100


def test_a_device_copy_is_kept_in_the_device_tier(make_manager):
    mgr = make_manager(device_budget=4 * PAGE)
    mgr.register("s", dtype=torch.float32, shape=(N,), home="device", data=torch.full((N,), 1.0)).wait()
    assert mgr.keep("s")
    assert mgr.device_tier.in_use == 2 * PAGE
    write(mgr, "s", 7.0, "device")
    mgr.restore("s")
    assert torch.equal(read(mgr, "s", "device"), torch.full((N,), 1.0))
    assert mgr.device_tier.in_use == PAGE


def test_misuse_is_an_illegal_transition(make_manager):
    mgr = make_manager()
    mgr.register("s", dtype=torch.float32, shape=(N,), home="host").wait()
    with pytest.raises(IllegalTransitionError, match="commit"):
        mgr.commit("s")
    assert mgr.keep("s")
    with pytest.raises(IllegalTransitionError, match="keep"):
        mgr.keep("s")
    mgr.acquire("s", "host")
    with pytest.raises(IllegalTransitionError, match="restore"):
        mgr.restore("s")
    mgr.release("s")
    mgr.restore("s")


def test_discard_drops_a_dirty_copy_unwritten(make_manager):
    mgr = make_manager(engine="threads")
    mgr.register("g", dtype=torch.float32, shape=(N,), home="nvme").wait()
    write(mgr, "g", 4.0)
    written = mgr.stats.bytes_moved["host->nvme"]
    mgr.discard("g")
    assert mgr.segments["g"].state == Residency.NVME and mgr.segments["g"].spent
    assert mgr.stats.bytes_moved["host->nvme"] == written
    with pytest.raises(IllegalTransitionError):
        mgr.acquire("g", "host")  # its bytes are gone: only a fetch that overwrites may take it


def test_without_an_nvme_budget_a_copy_never_takes_the_disk_s_reserve(small_tmpfs_dir):
    """On a 1 MiB filesystem (its reserve 5%: 51 KiB) and no nvme budget: a kept copy-on-write extent is refused
    where it would leave the filesystem less than its reserve, so a speculative step never fills the disk."""
    store = NvmeStoreConfig(nvme_path=small_tmpfs_dir, grow_step=4 * PAGE, aio=AioConfig(engine="threads"))
    mgr = SwapManager(SwapConfig(nvme=store, host_budget=512 * PAGE, prefetch_bytes=0))
    try:
        numel = 96 * PAGE // 4  # 384 KiB a segment: two fit the disk, a copy of one more does not
        mgr.register("a", dtype=torch.float32, shape=(numel,), home="nvme").wait()
        mgr.register("b", dtype=torch.float32, shape=(numel,), home="nvme").wait()
        stat = os.statvfs(small_tmpfs_dir)
        assert stat.f_bavail * stat.f_frsize < numel * 4 + int(0.05 * stat.f_blocks * stat.f_frsize)
        assert mgr.store.spare_bytes() < numel * 4
        assert not mgr.keep("a") and mgr.segments["a"].kept is None
    finally:
        mgr.close()
