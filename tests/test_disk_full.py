"""The disk under the nvme store filling up during training (not during a save), on a real filesystem: a 64 MiB
tmpfs as nvme_path, filled by another file while the store or the engine is open (skipped where mounting is not
permitted).

- The store grows by its grow_step where that fits, else by just what the request needs; only when even that
  does not fit is it a StoreFullError (ENOSPC, naming the file), the store and its bytes unchanged.
- The swap manager, where a dirty copy cannot be written for want of room, makes room with other copies (a
  prefetch waits); only where none can go is it that StoreFullError, never a pin left behind or a byte changed.
- Without an nvme budget the speculative step keeps no copy-on-write extent that would take the filesystem's
  reserve: on a full disk it steps in place, bitwise as on a roomy one. With a budget larger than the disk, a
  step that must grow the store (the first speculative step: its state goes to fresh extents, copy on write)
  fails with that StoreFullError, raised on the training thread also where the background thread stepping the
  optimizer met it. The store's bytes read back as they were; close() removes the swap file; the checkpoint
  saved before loads elsewhere and trains on bitwise as a run that never met the full disk.
- Once the store has its room, a full disk changes nothing: steps go on, bitwise.
"""
from __future__ import annotations

import errno
import os

import pytest
import torch

from checkpoint_models import assert_same, ds_config, snapshot, tiny_lm, train
from conftest import mounted

import zero
from tiering import AioConfig, NvmeStore, NvmeStoreConfig, StoreFullError, SwapConfig, SwapManager, aligned_empty

MiB = 1 << 20
HOST_BUDGET = 128 << 10
"""Less than a quarter of the state (256 KiB on nvme): every step writes state back to nvme."""
STATE_PARTS = ("param", "master", "exp_avg", "exp_avg_sq")


@pytest.fixture
def small_disk():
    with mounted("tmpfs", "size=64m") as directory:
        yield directory


def fill(directory: str) -> str:
    """Write a file in `directory` until its filesystem has not a byte left; its path."""
    path = os.path.join(directory, "filler")
    with open(path, "wb", buffering=0) as f:
        for block in (b"\0" * MiB, b"\0" * 4096):
            while True:
                try:
                    f.write(block)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
    return path


def engine(nvme_path, *, speculative: bool = True, nvme_budget: str | None = None):
    """ZeRO-3, bf16, parameters and optimizer state on nvme. No clipping, so every step speculates."""
    config = ds_config(3, "bf16", "nvme", str(nvme_path), sub_group_size=2048)
    config["gradient_clipping"] = 0.0
    config["zero_tiering"] = {"host_budget": HOST_BUDGET, "speculative_step": speculative}
    if nvme_budget is not None:
        config["zero_tiering"]["nvme_budget"] = nvme_budget
    return zero.initialize(model=tiny_lm(), config=config)[0]


def same_state(a: dict, b: dict) -> bool:
    """The tensors of two snapshots (not the counters) are equal, bitwise."""
    keys = [key for key in a if key.split("/")[0] in STATE_PARTS]
    return bool(keys) and all(torch.equal(a[key], b[key]) for key in keys)


def test_growth_falls_back_to_what_the_request_needs(small_disk):
    """A step (the file's size, up to grow_step) larger than the disk's free space: the file grows by just the
    extent; a step that fits is taken whole; on the full disk a StoreFullError, the file and its bytes as they were."""
    config = NvmeStoreConfig(nvme_path=small_disk, grow_step=256 * MiB, aio=AioConfig(engine="threads"))
    with NvmeStore(config) as store, NvmeStore(NvmeStoreConfig(nvme_path=small_disk, grow_step=32 * MiB)) as other:
        extent = store.allocate(16 * MiB)
        assert store.capacity == 16 * MiB == os.path.getsize(store.path)
        data = aligned_empty(16 * MiB).fill_(0x5A)
        store.write(extent, data).wait()
        other.allocate(16 * MiB)
        other.allocate(4096)
        assert other.capacity == 32 * MiB  # 32 MiB free: the step (its size, 16 MiB) fits, and is taken

        filler = fill(small_disk)
        with pytest.raises(StoreFullError) as info:
            store.allocate(4 * MiB)
        err = info.value
        assert err.errno == errno.ENOSPC and err.path == store.path and store.path in str(err)
        assert err.requested == 4 * MiB  # what the request needed: the 256 MiB step was refused first
        assert store.capacity == store.used_bytes == 16 * MiB == os.path.getsize(store.path)
        back = aligned_empty(16 * MiB)
        store.read(extent, back).wait()
        assert torch.equal(back, data)

        os.unlink(filler)
        store.allocate(4 * MiB)  # room again: its step (16 MiB) where the disk has it, else what it needs
        assert store.capacity in (20 * MiB, 32 * MiB) and store.capacity == os.path.getsize(store.path)


def test_the_swap_manager_makes_room_without_the_disk_where_it_can_and_names_the_disk_where_not(small_disk):
    """A dirty copy that needs a fresh extent (copy on write) cannot be written on the full disk: a prefetch
    then waits instead of failing, a fetch drops a clean copy instead, and only where no other copy can go is
    it a StoreFullError; nothing is left pinned, no bytes change, and with room again all is written."""
    n = 16 << 10  # 64 KiB of fp32 a segment; the host budget holds two
    values = {name: torch.full((n,), float(i)) for i, name in enumerate("abc")}
    # grow_step 4 KiB: the file holds the three segments and nothing more, so a fresh extent must grow it.
    config = SwapConfig(host_budget=2 * 64 << 10, nvme=NvmeStoreConfig(nvme_path=small_disk, grow_step=4096))
    with SwapManager(config) as swap:
        for name, data in values.items():
            swap.register(name, dtype=torch.float32, shape=(n,), home="nvme", data=data).wait()
        assert swap.keep("a")  # its next write-back goes to a fresh extent: the file must grow
        with swap.held("a", "host", dirty=True) as a:
            a.add_(10)
        filler = fill(small_disk)

        swap.prefetch(["b", "c"], "host").wait()  # b is read; c would need a's room: it waits
        with swap.held("b", "host") as b:  # the read-ahead tries c again, and waits again
            assert torch.equal(b, values["b"])
        with swap.held("c", "host") as c:  # b's clean copy goes instead of a's
            assert torch.equal(c, values["c"])
            with pytest.raises(StoreFullError) as info:  # only a's room is left, and it cannot be written
                swap.acquire("b", "host")
        err = info.value
        assert err.errno == errno.ENOSPC and err.path == swap.store.path

        os.unlink(filler)
        for name in values:
            swap.evict(name).wait()  # nothing left pinned; a written to its fresh extent now
        swap.commit("a")
        for name, data in values.items():
            with swap.held(name, "host") as tensor:
                assert torch.equal(tensor, data + 10 if name == "a" else data)
    assert os.listdir(small_disk) == []


def test_a_full_disk_fails_the_step_that_must_grow_the_store(tmp_path, small_disk):
    """Resumed from a checkpoint on a disk that then fills up: the first step's speculating optimizer writes its
    state to fresh extents, and the file cannot grow. (Later steps mostly reuse the extents the first one
    freed, so it is the first step after a start that surely must grow the file.) An nvme budget larger than the
    disk is what lets the speculation ask: without one it leaves the disk its reserve (the next test)."""
    checkpoint = tmp_path / "checkpoint"
    first = engine(small_disk, nvme_budget="1GiB")
    try:
        train(first, 1)
        first.save_checkpoint(checkpoint, tag="one")
        saved = snapshot(first)
    finally:
        first.close()

    resumed = engine(small_disk, nvme_budget="1GiB")
    try:
        resumed.load_checkpoint(checkpoint)
        store = resumed.swap.store
        filler = fill(small_disk)
        written = resumed.swap.stats.bytes_moved["host->nvme"]
        with pytest.raises(StoreFullError) as info:
            train(resumed, 1)
        err = info.value
        assert err.errno == errno.ENOSPC and err.path == store.path and store.path in str(err)
        assert resumed.swap.stats.bytes_moved["host->nvme"] > written, "the step wrote state to nvme before failing"

        os.unlink(filler)
        try:  # every segment read back through its checksum: as loaded, the failed step rolled back
            after = snapshot(resumed)
        except StoreFullError:  # where the backward met the full disk first, the optimizer's thread's is next
            after = snapshot(resumed)
        assert same_state(after, saved)
    finally:
        resumed.close()
    assert not os.path.exists(store.path) and os.listdir(small_disk) == []

    for name in ("roomy", "reference"):
        (tmp_path / name).mkdir()
    fresh = engine(tmp_path / "roomy")
    reference = engine(tmp_path / "reference")
    try:
        fresh.load_checkpoint(checkpoint)
        assert_same(snapshot(fresh), saved)
        train(fresh, 1)
        train(reference, 2)
        assert_same(snapshot(fresh), snapshot(reference))
    finally:
        fresh.close()
        reference.close()


def test_without_an_nvme_budget_a_full_disk_turns_the_speculation_down(tmp_path, small_disk):
    """The same resumed step on the full disk, no nvme budget: no sub-group keeps a copy-on-write extent (that would
    take the filesystem's reserve), every one steps at the boundary over its own extents, and training goes on
    bitwise as on a roomy disk."""
    checkpoint = tmp_path / "checkpoint"
    first = engine(small_disk)
    try:
        train(first, 1)
        first.save_checkpoint(checkpoint, tag="one")
    finally:
        first.close()
    (tmp_path / "roomy").mkdir()
    resumed, roomy = engine(small_disk), engine(tmp_path / "roomy")
    try:
        resumed.load_checkpoint(checkpoint)
        roomy.load_checkpoint(checkpoint)
        fill(small_disk)
        capacity = resumed.swap.store.capacity
        losses = train(resumed, 1)
        assert resumed.speculation.stats.stepped_early == 0 and resumed.swap.store.capacity == capacity
        assert torch.equal(torch.stack(losses), torch.stack(train(roomy, 1)))
        assert_same(snapshot(resumed), snapshot(roomy))
    finally:
        resumed.close()
        roomy.close()


def test_a_full_disk_changes_nothing_once_the_store_has_its_room(tmp_path, small_disk):
    """Without speculation nothing is allocated after the state is registered: write-backs land in extents the
    file already holds, and training goes on bitwise."""
    full = engine(small_disk, speculative=False)
    reference = engine(tmp_path, speculative=False)
    try:
        train(full, 1)
        fill(small_disk)
        written = full.swap.stats.bytes_moved["host->nvme"]
        losses = train(full, 2)
        assert full.swap.stats.bytes_moved["host->nvme"] > written
        assert torch.equal(torch.stack(train(reference, 3)[-len(losses):]), torch.stack(losses))
        assert_same(snapshot(full), snapshot(reference))
    finally:
        full.close()
        reference.close()
