"""An nvme_path of several directories (one per SSD): one store file per directory, each with its own engine.

- Placement: segments alternate between the files (the least-used first), read back bitwise, and their bytes
  are in the file the extent names; both files exist while the store is open and are gone after close.
- One directory in a list is the plain store: one file, the same path.
- A swap manager over two directories: register / evict / fetch round trips with checksums, a flipped byte
  caught and named with its file.
- Training through zero.initialize with a two-directory nvme_path gives the one-directory run's losses and
  state, bit for bit, with state in both files.
- Bad input: a missing or read-only directory among good ones is an NvmePathError naming it (the good ones
  keep no file); empty, repeated or non-path lists are config errors naming nvme_path; a full disk under one
  file sends segments to the other, and StoreFullError names a file only when no file has room; the nvme
  budget covers the files together.
"""
from __future__ import annotations

import os

import pytest
import torch

from checkpoint_models import assert_same, build, snapshot, train
from conftest import PAGE, mounted
from tiering import (
    AioConfig,
    BudgetExceededError,
    ChecksumMismatchError,
    NvmePathError,
    NvmeStore,
    NvmeStoreConfig,
    StoreFullError,
    SwapConfig,
    SwapManager,
    TieringConfigError,
    aligned_empty,
    gather,
)
from zero.config import ConfigError

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def two_dirs(tmp_path) -> list[str]:
    dirs = [tmp_path / "nvme0", tmp_path / "nvme1"]
    for d in dirs:
        d.mkdir()
    return [str(d) for d in dirs]


def store_over(dirs, *, engine: str = "threads", budget: int | None = None, grow_step: int = 256 * KiB) -> NvmeStore:
    return NvmeStore(NvmeStoreConfig(nvme_path=dirs, budget=budget, grow_step=grow_step, aio=AioConfig(engine=engine)))


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    buffer = aligned_empty(nbytes)
    buffer.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return buffer


def read_back(store: NvmeStore, extent) -> torch.Tensor:
    buffer = aligned_empty(extent.length)
    store.read(extent, buffer).wait(timeout=30)
    return buffer


# -- placement ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["libaio", "threads"])
def test_segments_alternate_between_the_files_and_read_back(two_dirs, engine):
    store = store_over(two_dirs, engine=engine)
    try:
        assert len(store.files) == 2 and store.engine_name == engine
        files = [f.path for f in store.files]
        for directory, path in zip(two_dirs, files):
            assert os.listdir(directory) == [os.path.basename(path)]
            assert os.path.basename(path).startswith("zt-") and path in store.path
        extents = [store.allocate(64 * KiB, f"s{i}") for i in range(6)]
        assert [e.file for e in extents] == [0, 1, 0, 1, 0, 1]
        assert store.files[0].used_bytes == store.files[1].used_bytes == 3 * 64 * KiB == store.used_bytes // 2
        assert store.capacity == sum(os.path.getsize(p) for p in files)
        data = [random_bytes(e.length, i) for i, e in enumerate(extents)]
        gather(store.write(e, d) for e, d in zip(extents, data)).wait(timeout=30)
        backs = [aligned_empty(e.length) for e in extents]
        gather(store.read(e, b) for e, b in zip(extents, backs)).wait(timeout=30)
        for extent, expected, back in zip(extents, data, backs):
            assert torch.equal(back, expected), f"{extent} differs after the round trip"
            assert store.path_of(extent) == files[extent.file]
            with open(files[extent.file], "rb") as f:
                f.seek(extent.offset)
                assert f.read(extent.length) == expected.numpy().tobytes(), f"{extent} is not in its file"
        store.free(extents[0])
        store.free(extents[2])  # file 0 now holds less: the next segment goes there
        assert store.allocate(64 * KiB).file == 0
        store.sync()
    finally:
        store.close()
    store.close()  # idempotent
    assert [os.listdir(d) for d in two_dirs] == [[], []]
    with pytest.raises(RuntimeError, match="closed"):
        store.allocate(PAGE)


def test_one_directory_in_a_list_is_the_plain_store(tmp_path):
    store = store_over([str(tmp_path)])
    try:
        (name,) = os.listdir(tmp_path)
        assert store.path == os.path.join(str(tmp_path), name) == store.files[0].path
        assert store.allocate(PAGE).file == 0 and store.stale.directory == str(tmp_path)
    finally:
        store.close()
    assert os.listdir(tmp_path) == []


def test_an_extent_of_another_file_count_is_refused(tmp_path):
    store = store_over([str(tmp_path)])
    try:
        extent = store.allocate(PAGE)._replace(file=1)
        with pytest.raises(ValueError, match="names file 1; this store has 1"):
            store.read(extent, aligned_empty(PAGE))
    finally:
        store.close()


# -- the swap manager ----------------------------------------------------------------------------------------


def flip_byte(path: str, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        (old,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([old ^ 0xFF]), offset)
    finally:
        os.close(fd)


def test_swap_manager_round_trips_over_two_directories_with_checksums(two_dirs):
    nvme = NvmeStoreConfig(nvme_path=two_dirs, grow_step=4 * PAGE, aio=AioConfig(engine="libaio"))
    mgr = SwapManager(SwapConfig(host_budget=8 * PAGE, device_budget=4 * PAGE, prefetch_bytes=0, nvme=nvme,
                                 checksums=True))
    try:
        data = {f"s{i}": torch.arange(i, i + 1500, dtype=torch.float32) for i in range(6)}  # 6000 bytes each
        gather(mgr.register(name, dtype=torch.float32, shape=(1500,), home="nvme", data=t)
               for name, t in data.items()).wait(timeout=30)
        assert {mgr.segments[name].extent.file for name in data} == {0, 1}
        for round_ in range(2):
            for name, expected in data.items():
                view = mgr.acquire(name, "device")
                assert torch.equal(view, expected), f"{name} differs in round {round_}"
                view.add_(1)
                expected.add_(1)
                mgr.release(name, dirty=True)
                mgr.evict(name).wait(timeout=30)
        extent = mgr.segments["s1"].extent
        path = mgr.store.path_of(extent)
        flip_byte(path, extent.offset + 10)
        with pytest.raises(ChecksumMismatchError) as info:
            mgr.fetch("s1", "host").wait(timeout=30)
        assert info.value.what == "s1" and path in str(info.value) and info.value.offset == extent.offset
        flip_byte(path, extent.offset + 10)  # repaired: it reads again
        assert torch.equal(mgr.acquire("s1", "host"), data["s1"])
        mgr.release("s1")
    finally:
        mgr.close()
    assert [os.listdir(d) for d in two_dirs] == [[], []]


# -- training ----------------------------------------------------------------------------------------------------


SWAPPING = {"sub_group_size": 2048, "tiering": {"host_budget": 128 << 10}}
"""Small sub-groups and a host budget that cannot hold all the state: every step swaps state to nvme."""


def run(nvme_path) -> tuple[list[torch.Tensor], dict, list[int]]:
    engine = build("stage3-bf16-nvme", nvme_path, tiering=SWAPPING["tiering"],
                   sub_group_size=SWAPPING["sub_group_size"])
    try:
        losses = train(engine, 2)
        return losses, snapshot(engine), [f.used_bytes for f in engine.swap.store.files]
    finally:
        engine.close()


def test_training_over_two_directories_matches_one(tmp_path, two_dirs):
    one = tmp_path / "one"
    one.mkdir()
    losses, state, (used,) = run(str(one))
    striped_losses, striped_state, striped_used = run(two_dirs)
    assert [x.item() for x in striped_losses] == [x.item() for x in losses]
    assert all(torch.equal(a, b) for a, b in zip(striped_losses, losses))
    assert_same(striped_state, state)
    assert all(u > 0 for u in striped_used) and sum(striped_used) == used
    assert [os.listdir(d) for d in (str(one), *two_dirs)] == [[], [], []]


def test_param_and_optimizer_nvme_paths_must_agree(two_dirs):
    with pytest.raises(ConfigError, match="must share one nvme_path") as info:
        build("stage3-bf16-nvme", two_dirs, offload_optimizer={"device": "nvme", "nvme_path": two_dirs[::-1]})
    assert info.value.key == "zero_optimization.offload_param.nvme_path"


# -- bad input ---------------------------------------------------------------------------------------------------


def test_a_missing_directory_is_named_and_the_good_one_keeps_no_file(two_dirs, tmp_path):
    missing = str(tmp_path / "no" / "such")
    with pytest.raises(NvmePathError, match="does not exist") as info:
        store_over([two_dirs[0], missing])
    assert info.value.path == missing and missing in str(info.value)
    assert os.listdir(two_dirs[0]) == []


def test_a_read_only_directory_is_named_and_the_good_one_keeps_no_file(two_dirs, readonly_dir):
    with pytest.raises(NvmePathError, match="writable") as info:
        store_over([two_dirs[0], readonly_dir])
    assert info.value.path == readonly_dir and readonly_dir in str(info.value)
    assert os.listdir(two_dirs[0]) == [] and os.listdir(readonly_dir) == []


@pytest.mark.parametrize("paths, words", [
    ([], "a non-empty list"),
    (["/tmp", 3], "a non-empty list"),
    (["/tmp", ""], "a non-empty list"),
    (["/tmp/x", "/tmp/x/"], "names the directory '/tmp/x' twice"),
])
def test_bad_directory_lists_are_config_errors_naming_nvme_path(paths, words):
    with pytest.raises(TieringConfigError, match=words) as info:
        NvmeStoreConfig(nvme_path=paths)
    assert info.value.field == "nvme_path" and info.value.value == tuple(paths)


def test_a_full_disk_under_one_file_sends_segments_to_the_other(tmp_path):
    """nvme0 is a 1 MiB tmpfs, nvme1 a disk: once nvme0 is full, every segment goes to nvme1, and what nvme0
    holds stays readable."""
    with mounted("tmpfs", "size=1m") as small:
        store = store_over([small, str(tmp_path)], grow_step=128 * KiB)
        try:
            extents, data = [], []
            for i in range(24):  # 24 x 128 KiB: more than the tmpfs holds
                extents.append(store.allocate(128 * KiB, f"s{i}"))
                data.append(random_bytes(128 * KiB, i))
                store.write(extents[-1], data[-1]).wait(timeout=30)
            on_small = sum(e.file == 0 for e in extents)
            assert 0 < on_small <= 8 and store.files[0].capacity == on_small * 128 * KiB
            assert [e.file for e in extents[-8:]] == [1] * 8
            for extent, expected in zip(extents, data):
                assert torch.equal(read_back(store, extent), expected)
        finally:
            store.close()
        assert os.listdir(small) == [] and os.listdir(tmp_path) == []


def test_store_full_is_raised_naming_a_file_when_no_file_has_room():
    with mounted("tmpfs", "size=1m") as first, mounted("tmpfs", "size=1m") as second:
        store = store_over([first, second], grow_step=128 * KiB)
        try:
            kept = [store.allocate(128 * KiB) for _ in range(2)]
            data = [random_bytes(128 * KiB, i) for i in range(2)]
            gather(store.write(e, d) for e, d in zip(kept, data)).wait(timeout=30)
            with pytest.raises(StoreFullError) as info:
                for _ in range(32):
                    store.allocate(128 * KiB, "filler")
            err = info.value
            assert err.path in [f.path for f in store.files] and err.path in str(err)
            assert err.size == os.path.getsize(err.path), "a failed grow must leave the file as it was"
            for extent, expected in zip(kept, data):
                assert torch.equal(read_back(store, extent), expected)
        finally:
            store.close()
        assert os.listdir(first) == os.listdir(second) == []


def test_the_nvme_budget_covers_the_files_together(two_dirs):
    store = store_over(two_dirs, budget=1 * MiB, grow_step=256 * KiB)
    try:
        extents = [store.allocate(256 * KiB) for _ in range(4)]
        assert [e.file for e in extents] == [0, 1, 0, 1] and store.capacity == 1 * MiB
        with pytest.raises(BudgetExceededError) as info:
            store.allocate(64 * KiB, "layers.3/adam")
        err = info.value
        assert (err.tier, err.budget, err.in_use, err.requested) == ("nvme", MiB, MiB, 64 * KiB)
        assert err.path == store.files[0].path and "layers.3/adam" in str(err)
        assert store.capacity == 1 * MiB == sum(os.path.getsize(f.path) for f in store.files)
        store.free(extents[1])
        assert store.allocate(256 * KiB).file == 1  # the freed room, in the file that has it
    finally:
        store.close()
