"""SwapManager.held: a segment acquired for the length of a block and released as asked, also when the block
raises."""
from __future__ import annotations

import pytest
import torch

from tiering import IllegalTransitionError, Residency, SwapManager

from conftest import PAGE
from test_swap_manager import page, states, use

R = Residency


def pins(mgr: SwapManager, name: str) -> tuple[int, str | None]:
    with mgr._lock:
        seg = mgr.segments[name]
        return seg.pins, seg.pinned_tier


@pytest.mark.parametrize("tier", ["host", "device"])
def test_held_yields_the_segments_view_in_the_tier_pinned_for_the_block(make_manager, tier):
    mgr = make_manager(engine="threads", device_budget=4 * PAGE)
    mgr.register("a", dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(3)).wait()
    with mgr.held("a", tier) as tensor:
        assert states(mgr, "a") == [R.HOST if tier == "host" else R.DEVICE] and pins(mgr, "a") == (1, tier)
        view = mgr.view("a")
        assert tensor.data_ptr() == view.data_ptr() and tensor.shape == view.shape == (PAGE // 4,)
        assert torch.equal(tensor, page(3))
    assert pins(mgr, "a") == (0, None)
    with pytest.raises(IllegalTransitionError):
        mgr.view("a")  # released: no view any more


@pytest.mark.parametrize("tier", ["host", "device"])
def test_held_dirty_makes_the_written_bytes_the_segments_and_clean_does_not(make_manager, engine, tier):
    """An nvme-homed segment evicted after a hold: written back when held dirty; when held clean its nvme copy
    is still current, so the host copy is dropped unwritten and the bytes written in the block are lost."""
    mgr = make_manager(engine=engine, device_budget=4 * PAGE)
    mgr.register("a", dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(3)).wait()
    written = mgr.stats.bytes_moved["host->nvme"]
    with mgr.held("a", tier, dirty=True) as tensor:
        tensor.fill_(7.0)
    mgr.evict("a").wait()
    assert states(mgr, "a") == [R.NVME] and mgr.stats.bytes_moved["host->nvme"] == written + PAGE
    assert torch.equal(use(mgr, "a", tier), page(7))
    with mgr.held("a", tier) as tensor:
        tensor.fill_(9.0)  # breaks the contract on purpose: written, but released clean
    mgr.evict("a").wait()
    assert mgr.stats.bytes_moved["host->nvme"] == written + PAGE  # nothing more was written
    assert torch.equal(use(mgr, "a", tier), page(7))


def test_held_releases_when_the_block_raises_and_the_error_propagates(make_manager, engine):
    mgr = make_manager(engine=engine, device_budget=4 * PAGE)
    mgr.register("a", dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(3)).wait()

    class Boom(Exception):
        pass

    with pytest.raises(Boom, match="in the block"):
        with mgr.held("a", "device", dirty=True) as tensor:
            tensor.fill_(4.0)
            raise Boom("in the block")
    assert pins(mgr, "a") == (0, None)
    mgr.evict("a").wait()  # unpinned, so it may go; released dirty, so the bytes written part way are kept
    assert states(mgr, "a") == [R.NVME]
    assert torch.equal(use(mgr, "a", "host"), page(4))
    with pytest.raises(Boom):
        with mgr.held("a", "host"):
            raise Boom()
    mgr.unregister("a")  # a pinned segment could not be unregistered
    assert mgr.segments == {} and mgr.pool.in_use == mgr.device_tier.in_use == mgr.store.used_bytes == 0


def test_held_passes_discard_and_overwrite_through(make_manager, engine):
    mgr = make_manager(engine=engine, device_budget=4 * PAGE)
    mgr.register("g", dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(3)).wait()
    with mgr.held("g", "host", discard=True) as tensor:
        assert torch.equal(tensor, page(3))
    with mgr._lock:
        seg = mgr.segments["g"]
        assert (seg.state, seg.host, seg.spent) == (R.NVME, None, True)  # dropped unwritten
    moved = dict(mgr.stats.bytes_moved)
    with pytest.raises(IllegalTransitionError, match="actual discarded"):
        with mgr.held("g", "host"):
            pass
    assert pins(mgr, "g") == (0, None)  # the fetch failed: nothing to release
    with mgr.held("g", "host", overwrite=True, dirty=True) as tensor:
        tensor.fill_(5.0)
    assert mgr.stats.bytes_moved == moved  # an overwrite reads nothing
    mgr.evict("g").wait()
    assert torch.equal(use(mgr, "g", "host"), page(5))
    mgr.acquire("g", "host")
    with pytest.raises(IllegalTransitionError, match="fetch to overwrite of 'g'.*pinned 1 times"):
        with mgr.held("g", "host", overwrite=True):
            pass
    assert pins(mgr, "g") == (1, "host")  # the refused hold released nothing it had not pinned
    mgr.release("g")
