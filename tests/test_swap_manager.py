"""Swap manager, call by call: the residency table, the trace (record, replay, departure), Belady and LRU
eviction and what goes first, reuse distance, checksums on nvme, failed reads, the Chrome trace, and the corner
cases of making room (prefetch and read-ahead: test_prefetch.py). Real components throughout (store, pool,
engines)."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from tiering import (
    BudgetExceededError,
    ChecksumMismatchError,
    IllegalTransitionError,
    IOFailedError,
    Residency,
    SwapConfig,
    SwapManager,
    TieringConfigError,
    TieringError,
)
from tiering.handle import Handle
from tiering.residency import TIER_ORDER, TRANSITIONS
from tiering.timeline import Timeline
from tiering.trace import Trace

from conftest import MOVE_TIMEOUT, PAGE  # noqa: F401  (make_manager: the fixture, from conftest)

R = Residency



def page(value: int, dtype=torch.float32) -> torch.Tensor:
    """One 4 KiB segment's worth of `value`."""
    return torch.full((PAGE // dtype.itemsize,), value, dtype=dtype)


def use(mgr: SwapManager, name: str, tier: str = "device", *, add: float | None = None) -> torch.Tensor:
    """Fetch, read (and with `add`, change) and release: one use of a segment in a step."""
    view = mgr.acquire(name, tier)
    out = view.clone()
    if add is not None:
        view.add_(add)
    mgr.release(name, dirty=add is not None)
    return out


def states(mgr: SwapManager, *names: str) -> list[Residency]:
    with mgr._lock:
        return [mgr.segments[n].state for n in names]


# -- residency -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("action", sorted(TRANSITIONS))
@pytest.mark.parametrize("state", list(Residency), ids=lambda s: s.name)
def test_residency_table_allows_its_edges_and_names_expected_and_actual_otherwise(state, action):
    sources, target = TRANSITIONS[action]
    if state in sources:
        assert state.after(action, "seg") is target
        return
    with pytest.raises(IllegalTransitionError) as info:
        state.after(action, "seg")
    err = info.value
    assert err.what == "seg" and err.action == action and err.actual == state.name
    for source in sources:
        assert source.name in err.expected
    assert f"expected state {err.expected}, actual {state.name}" in str(err) and "'seg'" in str(err)


def test_residency_table_moves_one_tier_at_a_time_and_every_move_can_fail_back():
    for action, (sources, target) in TRANSITIONS.items():
        assert len(sources) == 1, action
        if action.startswith("claim"):  # a spent segment's buffer is allocated where it is wanted: no move
            assert not target.moving and TIER_ORDER[target.tier] > TIER_ORDER[next(iter(sources)).tier], action
        if action.endswith("_failed"):
            (moving,) = sources
            start = next(s for a, (src, t) in TRANSITIONS.items() if t is moving for s in src)
            assert moving.moving and target is start, action  # a failed move rolls back to where it began
    settled = {s for s in Residency if not s.moving}
    assert settled == {R.NVME, R.HOST, R.DEVICE}
    for moving in set(Residency) - settled:
        assert any(moving in src for src, _ in TRANSITIONS.values()), moving  # every move can end


def test_bad_tiers_and_registrations_raise_typed_errors(make_manager):
    mgr = make_manager(device_budget=4 * PAGE)
    with pytest.raises(TieringConfigError, match="home"):
        mgr.register("a", dtype=torch.float32, shape=(4,), home="disk")
    with pytest.raises(TieringError, match="no nvme store"):
        mgr.register("a", dtype=torch.float32, shape=(4,), home="nvme")
    with pytest.raises(ValueError, match="expected torch.float32 x 4"):
        mgr.register("a", dtype=torch.float32, shape=(4,), home="host", data=torch.zeros(5))
    assert mgr.segments == {} and mgr.pool.in_use == 0
    mgr.register("a", dtype=torch.float32, shape=(2, 2), home="host", data=torch.ones(4))
    with pytest.raises(ValueError, match="already registered"):
        mgr.register("a", dtype=torch.float32, shape=(4,), home="host")
    with pytest.raises(TieringConfigError, match="tier"):
        mgr.fetch("a", "nvme")
    with pytest.raises(KeyError, match="'b'"):
        mgr.fetch("b")
    assert torch.equal(mgr.acquire("a", "host"), torch.ones(2, 2))


# -- trace -------------------------------------------------------------------------------------------------

def test_trace_records_replays_and_adopts_a_departing_order():
    trace = Trace()
    for name in "abc":
        trace.record(name, "device", PAGE)
    assert not trace.ready and list(trace.upcoming()) == []
    trace.end_step()
    assert trace.ready and [n for n, _ in trace.upcoming()] == ["a", "b", "c"]
    trace.record("a", "device", PAGE)
    assert trace.next_use("b") == 0 and trace.next_use("c") == 1 and trace.next_use("a") == 2  # wraps
    assert trace.next_use_bytes("c") == PAGE and trace.next_use_bytes("a") == 2 * PAGE
    assert trace.next_use("zz") == float("inf")
    trace.record("c", "device", PAGE)  # departs: b was next
    assert trace.departures == 1 and not trace.ready and list(trace.upcoming()) == []
    assert trace.next_use("b") == float("inf")  # not trusted any more
    trace.record("b", "device", PAGE)
    trace.end_step()
    assert trace.uses == [("a", "device"), ("c", "device"), ("b", "device")] and trace.ready
    for name in "acb":  # the new order is followed without departing
        trace.record(name, "device", PAGE)
    trace.end_step()
    assert trace.departures == 1


def test_step_in_another_order_is_correct_counts_a_departure_and_is_adopted(make_manager, engine):
    mgr = make_manager(engine=engine, device_budget=2 * PAGE, host_budget=2 * PAGE, prefetch_bytes=2 * PAGE)
    for i in range(5):
        mgr.register(f"s{i}", dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(i)).wait()
    order = [f"s{i}" for i in range(5)]
    expected = {f"s{i}": float(i) for i in range(5)}
    for step, names in enumerate([order, order, order[::-1], order[::-1]]):
        for name in names:
            assert torch.equal(use(mgr, name, add=1.0), page(expected[name]))
            expected[name] += 1
        assert mgr.trace.departures == (1 if step >= 2 else 0)
        mgr.end_step()
        assert [n for n, _ in mgr.trace.uses] == names
    for name in order:
        mgr.evict(name).wait()
        assert torch.equal(use(mgr, name, "host"), page(expected[name]))


# -- eviction order ------------------------------------------------------------------------------------------

def test_eviction_is_lru_before_a_trace_and_belady_once_one_exists(make_manager):
    mgr = make_manager(device_budget=3 * PAGE)
    for name in "abcd":
        mgr.register(name, dtype=torch.float32, shape=(PAGE // 4,), home="host")
    for name in "abc":
        use(mgr, name)
    use(mgr, "d")  # no trace yet: the least recently used (a) goes
    assert states(mgr, "a", "b", "c", "d") == [R.HOST, R.DEVICE, R.DEVICE, R.DEVICE]
    for name in "abc":  # the recorded step: a b c d a b c
        use(mgr, name)
    mgr.end_step()
    for name in "abc":  # replay; device holds a, b, c (d was evicted last)
        use(mgr, name)
    assert states(mgr, "a", "b", "c", "d") == [R.DEVICE, R.DEVICE, R.DEVICE, R.HOST]
    use(mgr, "d")  # next uses: a in 0, b in 1, c in 2: Belady evicts c (LRU would evict a)
    assert states(mgr, "a", "b", "c", "d") == [R.DEVICE, R.DEVICE, R.HOST, R.DEVICE]


def test_a_fetch_waits_for_a_release_pending_on_a_copy_instead_of_finding_the_tier_full(make_manager):
    """`release_after`: a copy reads a's pinned bytes; a fetch of b that needs a's room waits for the copy's end
    (then a's release) rather than raising BudgetExceededError, and a pin with no such release still raises."""
    mgr = make_manager(device_budget=PAGE)
    for name in "ab":
        mgr.register(name, dtype=torch.float32, shape=(PAGE // 4,), home="host", data=page(ord(name)))
    mgr.acquire("a")
    copy = Handle(label="a copy reading a")
    mgr.release_after("a", copy)
    threading.Timer(0.2, copy.part_done).start()
    assert torch.equal(mgr.acquire("b"), page(ord("b")))  # waited: a released and evicted
    assert states(mgr, "a", "b") == [R.HOST, R.DEVICE]
    with pytest.raises(BudgetExceededError):
        mgr.acquire("a")  # b is pinned with no release coming


def test_reuse_distance_evicts_at_release_what_is_used_far_later(make_manager):
    for distance, b_state in ((PAGE, R.HOST), (None, R.DEVICE)):
        mgr = make_manager(device_budget=8 * PAGE, reuse_distance=distance)
        for name in "abc":
            mgr.register(name, dtype=torch.float32, shape=(PAGE // 4,), home="host")
        for _ in range(2):  # step 1 records a b a c; step 2 replays it
            for name in "abac":
                use(mgr, name)
            mgr.end_step()
        use(mgr, "a")  # a is used again after one page (b): stays
        assert states(mgr, "a") == [R.DEVICE]
        use(mgr, "b")  # b is used again after 3 pages (a c, then a of the next step)
        assert states(mgr, "a", "b") == [R.DEVICE, b_state]


def test_reuse_distance_leaves_host_copies_to_eviction_under_pressure(make_manager, engine):
    """Writing a host copy back at release and reading it again next step moved every optimizer state byte
    each step even with room to keep most of it; only a device copy goes early."""
    mgr = make_manager(engine=engine, reuse_distance=0)
    for name in "ab":
        mgr.register(name, dtype=torch.float32, shape=(PAGE // 4,), home="nvme").wait()
    for step in range(3):  # step 0 records a b; steps 1 and 2 replay it with a trace
        if step == 1:
            moved = dict(mgr.stats.bytes_moved)
        for name in "ab":
            use(mgr, name, "host", add=1.0)
        mgr.end_step()
    assert states(mgr, "a", "b") == [R.HOST, R.HOST]
    assert dict(mgr.stats.bytes_moved) == moved, "a host copy was written back (and read again)"


def test_reuse_distance_evicts_nothing_before_a_trace_exists(make_manager):
    """Without a trace no one knows when a segment comes back: evicting at every release would write a
    segment released between sub-steps (a unit's shard, once per sub-group) again and again."""
    mgr = make_manager(device_budget=8 * PAGE, reuse_distance=0)
    for name in "ab":
        mgr.register(name, dtype=torch.float32, shape=(PAGE // 4,), home="host")
    for name in "abab":
        use(mgr, name, add=1.0)
    assert states(mgr, "a", "b") == [R.DEVICE, R.DEVICE]
    assert "device->host" not in mgr.stats.bytes_moved


def test_a_copy_expected_to_be_overwritten_goes_first_once_home_holds_its_bytes(make_manager):
    mgr = make_manager(engine="threads", host_budget=2 * PAGE)
    for i, name in enumerate("abc"):
        mgr.register(name, dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(i)).wait()
    use(mgr, "a", "host")
    use(mgr, "b", "host")
    mgr.expect_overwrite("b")
    use(mgr, "c", "host")  # LRU alone would take a's room
    assert states(mgr, "a", "b", "c") == [R.HOST, R.NVME, R.HOST]
    assert mgr.segments["b"].overwrite_expected
    mgr.acquire("b", "host", overwrite=True).fill_(5.0)  # the fetch it was expecting ends the hint
    mgr.release("b", dirty=True)
    assert not mgr.segments["b"].overwrite_expected
    assert torch.equal(use(mgr, "b", "host"), page(5))


def test_a_dirty_copy_expected_to_be_overwritten_keeps_its_bytes(make_manager):
    """Only a hint: a step that is skipped after all, or a checkpoint, reads the segment, so a copy home does not
    hold yet is neither dropped nor given up first; evicted in its turn, it is written."""
    mgr = make_manager(engine="threads", host_budget=2 * PAGE)
    for i, name in enumerate("abc"):
        mgr.register(name, dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(i)).wait()
    use(mgr, "b", "host")
    use(mgr, "a", "host", add=1.0)
    mgr.expect_overwrite("a")
    use(mgr, "c", "host")  # b, the least recently used and clean, goes: a is not home yet
    assert states(mgr, "a", "b", "c") == [R.HOST, R.NVME, R.HOST]
    use(mgr, "b", "host")  # now a is the least recently used: written, then dropped
    assert states(mgr, "a", "b", "c") == [R.NVME, R.HOST, R.HOST]
    assert torch.equal(use(mgr, "a", "host"), page(1))


# -- spent bytes: discard and overwrite ------------------------------------------------------------------------

@pytest.mark.parametrize("tier", ["host", "device"])
def test_discarded_bytes_are_never_written_and_an_overwrite_reads_nothing(make_manager, engine, tier):
    mgr = make_manager(engine=engine, device_budget=8 * PAGE)
    mgr.register("g", dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=torch.full((PAGE // 4,), 3.0)).wait()
    written = mgr.stats.bytes_moved["host->nvme"]
    mgr.acquire("g", tier).fill_(7.0)
    mgr.release("g", dirty=True)
    mgr.acquire("g", tier)
    moved = dict(mgr.stats.bytes_moved)
    mgr.release("g", discard=True)  # spent: every copy above nvme is dropped, unwritten
    with mgr._lock:
        seg = mgr.segments["g"]
        assert (seg.state, seg.host, seg.device, seg.spent) == (R.NVME, None, None, True)
    assert mgr.pool.in_use == mgr.device_tier.in_use == 0
    assert mgr.stats.bytes_moved == moved and moved["host->nvme"] == written
    with pytest.raises(IllegalTransitionError, match="actual discarded"):
        mgr.acquire("g", tier)  # its bytes are gone: only an overwrite may fetch it
    mgr.acquire("g", tier, overwrite=True).fill_(5.0)
    mgr.release("g", dirty=True)
    assert mgr.stats.bytes_moved == moved
    mgr.evict("g").wait()  # the overwritten bytes are the segment's: written back, read back
    assert torch.equal(use(mgr, "g", tier), torch.full((PAGE // 4,), 5.0))
    assert mgr.stats.bytes_moved["host->nvme"] == written + PAGE


def test_overwrite_of_a_pinned_segment_and_dirty_discard_are_refused(make_manager):
    mgr = make_manager(device_budget=8 * PAGE)
    mgr.register("a", dtype=torch.float32, shape=(PAGE // 4,), home="host", data=torch.ones(PAGE // 4))
    mgr.acquire("a", "host")
    with pytest.raises(IllegalTransitionError, match="fetch to overwrite of 'a'.*pinned 1 times"):
        mgr.acquire("a", "host", overwrite=True)
    with pytest.raises(ValueError, match="dirty and discard"):
        mgr.release("a", dirty=True, discard=True)
    mgr.release("a")
    assert torch.equal(use(mgr, "a", "host"), torch.ones(PAGE // 4))  # nothing was changed by the refusals


# -- integrity and failures ---------------------------------------------------------------------------------

def flip_byte(path: str, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        (old,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([old ^ 0xFF]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_checksum_mismatch_names_the_segment_and_the_manager_stays_usable(make_manager, engine):
    mgr = make_manager(engine=engine, device_budget=4 * PAGE)
    data = torch.arange(3000, dtype=torch.int16)  # 6000 bytes: not a multiple of 4 KiB
    mgr.register("w", dtype=torch.int16, shape=(3000,), home="nvme", data=data).wait()
    mgr.register("other", dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(7)).wait()
    offset = mgr.segments["w"].extent.offset + 5000
    flip_byte(mgr.store.path, offset)
    for tier in ("device", "host"):
        with pytest.raises(ChecksumMismatchError, match="'w'") as info:
            mgr.fetch("w", tier).wait()
        assert info.value.what == "w" and info.value.path == mgr.store.path
    with mgr._lock:
        seg = mgr.segments["w"]
        assert (seg.state, seg.pins, seg.host, seg.device) == (R.NVME, 0, None, None)
    assert mgr.pool.in_use == 0 and mgr.device_tier.in_use == 0
    with pytest.raises(IllegalTransitionError):
        mgr.view("w")
    assert torch.equal(use(mgr, "other"), page(7))
    flip_byte(mgr.store.path, offset)  # repaired: the same segment reads again
    assert torch.equal(use(mgr, "w", "host"), data)


def test_without_checksums_a_flipped_byte_goes_unnoticed(make_manager):
    mgr = make_manager(engine="threads", checksums=False)
    mgr.register("w", dtype=torch.uint8, shape=(100,), home="nvme", data=torch.zeros(100, dtype=torch.uint8)).wait()
    flip_byte(mgr.store.path, mgr.segments["w"].extent.offset + 3)
    assert use(mgr, "w", "host")[3].item() == 0xFF


def test_failed_nvme_read_raises_typed_error_and_leaves_the_segment_consistent(make_manager, engine):
    mgr = make_manager(engine=engine, device_budget=4 * PAGE)
    mgr.register("a", dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(3)).wait()
    mgr.register("b", dtype=torch.float64, shape=(100,), home="host", data=torch.ones(100, dtype=torch.float64))
    os.truncate(mgr.store.path, 0)  # the bytes under the store are gone
    for tier in ("device", "host"):
        with pytest.raises(IOFailedError) as info:
            mgr.fetch("a", tier).wait(MOVE_TIMEOUT)
        assert isinstance(info.value, TieringError) and info.value.path == mgr.store.path
    with mgr._lock:
        seg = mgr.segments["a"]
        assert (seg.state, seg.pins, seg.pinned_tier, seg.move) == (R.NVME, 0, None, None)
        assert seg.nvme_current and seg.host is None and seg.device is None
    assert mgr.pool.in_use == mgr.segments["b"].host.capacity and mgr.device_tier.in_use == 0
    assert torch.equal(use(mgr, "b"), torch.ones(100, dtype=torch.float64))  # the rest still works
    mgr.unregister("a")
    assert mgr.store.used_bytes == 0


def test_registration_the_store_cannot_hold_leaves_nothing_behind(make_manager):
    mgr = make_manager(engine="threads", nvme_budget=2 * PAGE)
    mgr.register("a", dtype=torch.float32, shape=(PAGE // 4,), home="nvme").wait()
    mgr.register("b", dtype=torch.float32, shape=(PAGE // 4,), home="nvme").wait()
    with pytest.raises(BudgetExceededError) as info:
        mgr.register("c", dtype=torch.float32, shape=(PAGE // 4,), home="nvme")
    assert info.value.tier == "nvme" and info.value.budget == 2 * PAGE
    assert "c" not in mgr.segments and mgr.pool.in_use == 0
    mgr.unregister("a")
    mgr.register("c", dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(5)).wait()
    assert torch.equal(use(mgr, "c", "host"), page(5))


def test_unregister_waits_for_a_move_in_flight(make_manager, engine):
    mgr = make_manager(engine=engine)
    for i in range(4):
        mgr.register(f"s{i}", dtype=torch.float32, shape=(PAGE,), home="nvme")  # writes left in flight
        mgr.unregister(f"s{i}")
    assert mgr.segments == {} and mgr.pool.in_use == 0 and mgr.store.used_bytes == 0


# -- making room -------------------------------------------------------------------------------------------

def test_room_on_device_passes_over_a_victim_with_no_room_below_and_keeps_the_segment_being_fetched(make_manager):
    """Device full of v (dirty, no host copy) and w (clean on nvme); host full of s (clean on nvme, being
    fetched) and host-homed segments. Fetching s to the device: v cannot go down (the only thing host could
    free is s itself, which must stay), so w must go instead."""
    mgr = make_manager(engine="threads", host_budget=4 * PAGE, device_budget=3 * PAGE)
    mgr.register("v", dtype=torch.float32, shape=(2 * PAGE // 4,), home="host")
    use(mgr, "v", add=1.0)  # dirty on the device; its host copy is stale
    mgr.register("w", dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(2)).wait()
    use(mgr, "w")
    mgr.register("s", dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(3)).wait()
    use(mgr, "s", "host")
    mgr.register("z", dtype=torch.float32, shape=(2 * PAGE // 4,), home="host")  # drops v's host copy
    mgr.register("z1", dtype=torch.float32, shape=(PAGE // 4,), home="host")  # drops w's host copy
    with mgr._lock:
        assert [(mgr.segments[n].state, mgr.segments[n].host is not None) for n in "vws"] == [
            (R.DEVICE, False), (R.DEVICE, False), (R.HOST, True)]
        assert mgr.segments["s"].host.capacity == PAGE
    assert mgr.pool.in_use == 4 * PAGE and mgr.device_tier.in_use == 3 * PAGE
    assert torch.equal(mgr.acquire("s"), page(3))
    mgr.release("s")
    assert states(mgr, "v", "w", "s") == [R.DEVICE, R.NVME, R.DEVICE]
    assert torch.equal(use(mgr, "v"), torch.ones(2 * PAGE // 4))


def test_a_fetch_waiting_for_room_another_fetch_holds_is_not_failed_by_that_fetch(make_manager):
    """Host room for one page; `a` is being read (its read held, then failed) when `c` is fetched: `c` waits for
    the room `a` holds and then reads its own bytes. `a`'s error is `a`'s caller's alone."""
    mgr = make_manager(engine="threads", host_budget=PAGE)
    for name, value in (("a", 1), ("c", 2)):
        mgr.register(name, dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(value)).wait()
        mgr.evict(name).wait(MOVE_TIMEOUT)
    held, read, a_extent = Handle(label="held read"), mgr.store.read, mgr.segments["a"].extent
    mgr.store.read = lambda extent, *args: held if extent == a_extent else read(extent, *args)
    fetch_a = mgr.fetch("a", "host")
    move = mgr.segments["a"].move
    callbacks = len(move._callbacks)
    out = {}
    waiter = threading.Thread(target=lambda: out.update(c=use(mgr, "c", "host")))
    waiter.start()
    for _ in range(int(MOVE_TIMEOUT / 0.01)):  # until `c` waits on `a`'s move for the room it holds
        if len(move._callbacks) > callbacks or not waiter.is_alive():
            break
        time.sleep(0.01)
    assert len(move._callbacks) > callbacks, "c did not wait for the room a's read holds"
    held.part_done(IOFailedError(mgr.store.path, "read", 0, PAGE, "held by the test"))
    waiter.join(MOVE_TIMEOUT)
    with pytest.raises(IOFailedError):
        fetch_a.wait(MOVE_TIMEOUT)
    assert torch.equal(out["c"], page(2))


def test_host_copy_under_a_pinned_device_copy_is_a_cache_that_may_go(make_manager):
    mgr = make_manager(engine="threads", host_budget=2 * PAGE, device_budget=4 * PAGE)
    for name in "abc":
        mgr.register(name, dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(ord(name))).wait()
    on_device = mgr.acquire("a")  # pinned on the device; its host copy stays behind as a cache
    mgr.acquire("b", "host")
    assert mgr.pool.in_use == 2 * PAGE
    assert torch.equal(mgr.acquire("c", "host"), page(ord("c")))  # room made by dropping a's host copy
    assert mgr.segments["a"].host is None and torch.equal(on_device, page(ord("a")))
    on_device.add_(1)
    mgr.release("a", dirty=True)
    mgr.release("b")
    mgr.release("c")
    mgr.evict("a").wait()  # written back through host: the cache was not needed
    assert torch.equal(use(mgr, "a", "host"), page(ord("a") + 1))


def test_budget_error_carries_the_numbers_and_changes_nothing(make_manager):
    mgr = make_manager(device_budget=2 * PAGE)
    mgr.register("a", dtype=torch.float32, shape=(PAGE // 4,), home="device")
    mgr.register("b", dtype=torch.int8, shape=(5000,), home="host")
    with pytest.raises(BudgetExceededError) as info:
        mgr.fetch("b")  # 5000 B take two pages; the device-homed a holds one of two
    err = info.value
    assert (err.tier, err.budget, err.in_use, err.requested, err.what) == ("device", 2 * PAGE, PAGE, 2 * PAGE, "b")
    assert "device budget 8.0 KiB exhausted: 4.0 KiB in use (segments 4.0 KiB), 8.0 KiB requested for 'b'" in str(err)
    assert states(mgr, "a", "b") == [R.DEVICE, R.HOST] and mgr.segments["b"].pins == 0


# -- stats and timeline ------------------------------------------------------------------------------------

def test_busy_seconds_is_the_union_of_the_lanes_intervals():
    """A read and a write in flight together keep the disk busy once: busy time is the union across lanes."""
    timeline = Timeline()
    timeline.add("r", "nvme->host", 10.0, 14.0)
    timeline.add("w", "host->nvme", 12.0, 16.0)  # overlaps the read by 2 s
    timeline.add("w2", "host->nvme", 20.0, 21.0)
    timeline.add("c", "compute", 0.0, 30.0)
    assert timeline.busy_seconds("nvme->host") == 4.0
    assert timeline.busy_seconds("nvme->host", "host->nvme") == 7.0  # [10, 16] and [20, 21]
    assert timeline.busy_seconds("nvme->host", "host->nvme", since=11.0) == 5.0  # spans starting at 12 and 20


def test_stats_count_bytes_per_tier_pair_peaks_and_stalls(make_manager):
    mgr = make_manager(engine="threads", device_budget=4 * PAGE)
    mgr.register("a", dtype=torch.int8, shape=(5000,), home="nvme").wait()
    use(mgr, "a", add=1)
    mgr.evict("a").wait()
    assert dict(mgr.stats.bytes_moved) == {"host->nvme": 10000, "nvme->host": 5000, "host->device": 5000,
                                           "device->host": 5000}
    assert mgr.stats.peak_bytes["host"] == 2 * PAGE and mgr.stats.peak_bytes["device"] == 2 * PAGE
    assert mgr.stats.peak_bytes["nvme"] == 2 * PAGE
    stalls = [s for s in mgr.timeline.spans if s[1] == "stall"]
    assert mgr.stats.stall_seconds == pytest.approx(sum(end - start for _, _, start, end, _ in stalls))
    assert mgr.stats.as_dict()["bytes_moved"]["host->nvme"] == 10000
    use(mgr, "a", "host")  # back from nvme: a miss
    use(mgr, "a", "host")  # still there: a hit
    assert (mgr.stats.hits, mgr.stats.misses) == (1, 2) and mgr.stats.hit_rate == pytest.approx(1 / 3)


def test_chrome_trace_is_valid_json_with_move_and_compute_events(make_manager, tmp_path):
    mgr = make_manager(engine="threads", device_budget=4 * PAGE)
    mgr.register("a", dtype=torch.float32, shape=(PAGE // 4,), home="nvme").wait()
    view = mgr.acquire("a")
    with mgr.compute("a"):
        view.add_(1)
    mgr.release("a", dirty=True)
    mgr.evict("a").wait()
    path = tmp_path / "trace.json"
    mgr.write_chrome_trace(str(path))
    doc = json.loads(path.read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    lanes = {e["cat"] for e in events}
    assert {"compute", "host->nvme", "nvme->host", "host->device", "device->host"} <= lanes
    for e in events:
        assert e["name"] == "a" and e["ts"] >= 0 and e["dur"] >= 0
        if e["cat"] != "compute" and e["cat"] != "stall":
            assert e["args"] == {"bytes": PAGE}
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert {"compute", "nvme->host"} <= names
    compute = next(e for e in events if e["cat"] == "compute")
    read = next(e for e in events if e["cat"] == "nvme->host")
    assert read["ts"] + read["dur"] <= compute["ts"] + 1  # the bytes arrived before they were used


def test_an_adopted_tensor_is_counted_on_the_device_until_its_copy_lands():
    """`adopt` takes a device tensor as a segment without copying it there: counted in the device budget, copied
    to its home on the copy stream, then dropped from the device; reading it back gives its bytes. Over the
    budget it is a BudgetExceededError; a strided tensor is refused."""
    data = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    with SwapManager(SwapConfig(host_budget=1 << 20, device_budget=32 << 10)) as swap:
        handle = swap.adopt("a", data.clone(), home="host")
        handle.wait()
        assert swap.segments["a"].state.tier == "host" and swap.device_tier.in_use == 0
        assert swap.stats.peak_bytes["device"] >= data.numel() * 4
        with swap.held("a") as view:
            assert torch.equal(view, data)
        with pytest.raises(BudgetExceededError):
            swap.adopt("big", torch.zeros(64, 1024), home="host")
        with pytest.raises(ValueError, match="contiguous"):
            swap.adopt("t", data.t(), home="host")
        swap.adopt("d", data.clone(), home="device").wait()
        assert swap.segments["d"].state.tier == "device"


@pytest.mark.parametrize("engine", ["libaio", "threads"])
def test_a_fresh_buffer_a_read_lands_in_is_made_off_the_lock(make_manager, engine, monkeypatch):
    """Touching a fresh buffer's pages takes ~10 ms a 100 MB: under the manager's lock every other thread, and the
    I/O's completions, would wait. A read's fresh buffer, and a claimed one (a fetch to overwrite), are made on the
    allocator thread, the lock not held, and the bytes are right; a staging buffer from acquire_host too."""
    from tiering import host_pool

    mgr = make_manager(engine=engine, host_budget=4 * PAGE)
    for name in "ab":
        mgr.register(name, dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(7)).wait()
    mgr.pool.trim()  # nothing cached: each needs a fresh buffer
    made = []
    real = host_pool.aligned_empty
    monkeypatch.setattr(host_pool, "aligned_empty", lambda size, pin=False: (
        made.append((threading.current_thread().name, mgr._lock._is_owned())), real(size, pin=pin))[1])
    assert torch.equal(use(mgr, "a", "host"), page(7))
    mgr.acquire("b", "host", overwrite=True).fill_(3)  # claimed: nothing read, the buffer made all the same
    mgr.release("b", dirty=True)
    staging = mgr.acquire_host(PAGE, "staging")
    staging.release()
    assert [owned for _, owned in made] == [False, False, False], made
    assert [name.split("_")[0] for name, _ in made[:2]] == ["tiering-alloc"] * 2
    assert torch.equal(use(mgr, "b", "host"), page(3))


def test_a_write_the_store_refuses_at_once_fails_its_move_and_the_bytes_stay_on_host(make_manager, engine):
    """A write-back whose submit raises on the calling thread (here: the store closed under the manager) ends the
    move with that error instead of leaving the segment WRITING forever: the copy stays on the host, current and
    dirty, and reads back as written."""
    mgr = make_manager(engine=engine)
    mgr.register("a", dtype=torch.float32, shape=(PAGE // 4,), home="nvme").wait()
    with mgr.held("a", "host", dirty=True) as view:
        view.fill_(3.0)
    mgr.store.close()
    with pytest.raises(RuntimeError, match="closed"):
        mgr.evict("a").wait(MOVE_TIMEOUT)
    seg = mgr.segments["a"]
    assert seg.state == Residency.HOST and seg.move is None and seg.host_current and not seg.nvme_current
    with mgr.held("a", "host") as view:
        assert torch.equal(view, torch.full((PAGE // 4,), 3.0))
