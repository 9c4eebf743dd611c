"""Prefetch along the trace and the caller's read-ahead: what is read ahead, within which budgets (prefetch_bytes,
max_live_bytes, the room there is), what a read-ahead may evict and what a fetch takes back from it, and what is
never read ahead (bytes a step overwrites or discards). Real components throughout (store, pool, engines)."""
from __future__ import annotations

import time

import pytest
import torch

from tiering import IllegalTransitionError, Residency, SwapManager

from conftest import MOVE_TIMEOUT, PAGE  # noqa: F401  (make_manager: the fixture, from conftest)
from test_swap_manager import page, states, use

R = Residency


def test_prefetch_skips_what_the_trace_overwrites_and_what_is_discarded(make_manager):
    mgr = make_manager(engine="threads", device_budget=16 * PAGE, prefetch_bytes=8 * PAGE)
    for name in "abc":
        mgr.register(name, dtype=torch.float32, shape=(PAGE // 4,), home="nvme").wait()

    def step() -> None:
        use(mgr, "a", "host")
        mgr.acquire("b", "host", overwrite=True).fill_(1.0)  # rewritten whole every step: never worth a read
        mgr.release("b", dirty=True)
        mgr.acquire("c", "host")
        mgr.release("c", discard=True)

    step()
    mgr.end_step()
    reads = mgr.stats.bytes_moved["nvme->host"]
    mgr.evict("a").wait()
    mgr.evict("b").wait()  # its write-back done, prefetch looks ahead along the trace: a, then b and c
    mgr.acquire("a", "host")
    time.sleep(0.2)  # a prefetch, had one started, would have landed
    with mgr._lock:
        assert [mgr.segments[n].state for n in "bc"] == [R.NVME, R.NVME]
    assert mgr.stats.bytes_moved["nvme->host"] == reads + PAGE  # a's bytes, nothing else
    mgr.release("a")


ODD = 3000
"""Bytes of each segment in the prefetch test: not a multiple of 4 KiB, so each copy takes a whole page."""


@pytest.mark.parametrize("prefetch_bytes, max_live, host_pages, ahead, staged", [
    (3 * ODD, None, 64, 3, 4),  # three ahead, topped up after each fetch; the other four read to host past them
    (8 * ODD, 2 * PAGE + ODD, 64, 1, 6),  # s0 and s1 take two pages; a third copy would pass max_live_bytes
    (ODD, None, 10, 1, 5),  # past the window, reads to host stop at half the host budget (5 of its 10 pages)
    (0, None, 64, 0, 0),  # prefetch off: nothing read ahead
])
def test_prefetch_follows_the_trace_within_prefetch_bytes_and_max_live_bytes(
        make_manager, prefetch_bytes, max_live, host_pages, ahead, staged):
    mgr = make_manager(engine="threads", device_budget=16 * PAGE, host_budget=host_pages * PAGE,
                       prefetch_bytes=prefetch_bytes, max_live_bytes=max_live)
    names = [f"s{i}" for i in range(8)]
    for i, name in enumerate(names):
        mgr.register(name, dtype=torch.uint8, shape=(ODD,), home="nvme", data=torch.full((ODD,), i, dtype=torch.uint8),
                     frozen=True)  # past the window, read on to host
    for name in names:
        use(mgr, name)
        assert mgr.stats.prefetches == 0  # nothing to follow while recording
    mgr.end_step()
    for name in names:
        mgr.evict(name).wait()
    assert mgr.stats.hits == 0 and mgr.stats.misses == 8

    mgr.acquire("s0")
    with mgr._lock:
        window = [n for n in names[1:] if mgr.segments[n].prefetched and not mgr.segments[n].staged]
        to_host = [n for n in names[1:] if mgr.segments[n].staged]
        untouched = [n for n in names[1:] if mgr.segments[n].state == R.NVME]
    assert window == names[1:1 + ahead]  # the next uses, in order, all the way to the device
    assert to_host == names[1 + ahead:1 + ahead + staged]  # then the next ones, read to host only
    assert untouched == names[1 + ahead + staged:]
    assert mgr.stats.prefetches == ahead + staged
    assert max_live is None or mgr.device_tier.in_use <= max_live
    mgr.release("s0")
    for i, name in enumerate(names[1:], 1):
        assert torch.equal(use(mgr, name), torch.full((ODD,), i, dtype=torch.uint8))
        assert max_live is None or mgr.device_tier.in_use <= max(max_live, (i + 1) * PAGE)
    assert mgr.stats.misses == 8 + 8 - mgr.stats.hits
    assert mgr.stats.hits == (7 if prefetch_bytes else 0)  # read ahead, in one window or the other: every one a hit


@pytest.mark.parametrize("order, staged", [("PVT", True), ("VPT", False)])
def test_a_read_ahead_past_the_window_evicts_only_what_is_needed_after_every_copy_in_use(make_manager, order, staged):
    """Past the prefetch window a frozen segment is read ahead to host, room taken only from a copy needed
    after every copy still in use: with P held in host memory while T is read ahead, V may go where P comes back
    first (PVT), not where V does (VPT: a fetch of T once P is released would drop P and keep V)."""
    mgr = make_manager(engine="threads", host_budget=2 * PAGE, prefetch_bytes=1)  # no page fits the window
    tiers = {"P": "host", "V": "host", "T": "device"}
    for i, name in enumerate("PVT"):
        mgr.register(name, dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(i),
                     frozen=name == "T").wait()
    for name in order:
        use(mgr, name, tiers[name])
    mgr.end_step()
    for name in "PVT":
        mgr.evict(name).wait()
    mgr.prefetch(["P", "V"], "host").wait()  # the host full, as a cache would hold them
    for name in order[:2]:  # the next step up to T, P held
        mgr.acquire(name, "host")
        if name == "V":
            mgr.release("V")
    mgr._prefetch_ahead()  # as every fetch does
    with mgr._lock:
        move = mgr.segments["T"].move
    if move is not None:
        move.wait(MOVE_TIMEOUT)
    with mgr._lock:
        assert mgr.segments["T"].staged == staged
        assert states(mgr, "V", "T") == ([R.NVME, R.HOST] if staged else [R.HOST, R.NVME])
    mgr.release("P")
    assert torch.equal(use(mgr, "T"), page(2))


def test_past_the_window_only_frozen_segments_are_read_ahead(make_manager):
    """A segment a step rewrites is not read ahead past the prefetch window (staging them read more bytes a
    step); a frozen one is, and a write to it (a checkpoint's load) still reaches nvme."""
    mgr = make_manager(engine="threads", prefetch_bytes=1)
    for i, name in enumerate("abc"):
        mgr.register(name, dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(i),
                     frozen=name == "c").wait()
    for name in "abc":
        use(mgr, name)
    mgr.end_step()
    for name in "abc":
        mgr.evict(name).wait()
    mgr.acquire("a")
    with mgr._lock:
        assert [mgr.segments[n].staged for n in "bc"] == [False, True]
    mgr.release("a")
    use(mgr, "c", add=5.0)
    mgr.evict("c").wait()
    assert torch.equal(use(mgr, "c"), page(7))


def test_evicting_a_prefetched_segment_undoes_the_prefetch(make_manager):
    mgr = make_manager(engine="threads", device_budget=4 * PAGE, prefetch_bytes=PAGE)
    mgr.register("a", dtype=torch.float32, shape=(PAGE // 4,), home="nvme").wait()
    mgr.prefetch(["a"]).wait()
    assert states(mgr, "a") == [R.DEVICE] and mgr.stats.prefetches == 1
    mgr.evict("a").wait()
    assert states(mgr, "a") == [R.NVME]
    use(mgr, "a")  # back from nvme: a miss, not a hit
    assert (mgr.stats.hits, mgr.stats.misses) == (0, 1)


def wait_moves(mgr: SwapManager, *names: str) -> None:
    for name in names:
        move = mgr.segments[name].move
        if move is not None:
            move.wait(MOVE_TIMEOUT)


def test_a_read_ahead_without_room_starts_as_room_frees_and_keeps_what_it_brought(make_manager):
    """Off the trace (a background optimizer step's reads are): what `prefetch` finds no room for starts once a
    release frees some, evicting a segment used and released before the ones the read-ahead brought."""
    mgr = make_manager(engine="threads", host_budget=2 * PAGE)
    for i, name in enumerate("abc"):
        mgr.register(name, dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(i)).wait()
    mgr.prefetch(["a", "b", "c"], "host")
    wait_moves(mgr, "a", "b")
    assert states(mgr, "a", "b", "c") == [R.HOST, R.HOST, R.NVME]  # no room for c, and a, b are not taken
    assert torch.equal(use(mgr, "a", "host"), page(0))  # a hit; its release frees room: c starts, a goes
    wait_moves(mgr, "c")
    assert states(mgr, "a", "b", "c") == [R.NVME, R.HOST, R.HOST]
    assert torch.equal(use(mgr, "b", "host"), page(1)) and torch.equal(use(mgr, "c", "host"), page(2))
    assert (mgr.stats.hits, mgr.stats.misses, mgr.stats.prefetches) == (3, 0, 3)
    mgr.prefetch(["a"], "host")  # a new read-ahead replaces what was left of the last one
    wait_moves(mgr, "a")
    assert states(mgr, "a", "b", "c") == [R.HOST, R.NVME, R.HOST]  # b, used before c, made the room
    mgr.acquire("a", "host")
    mgr.acquire("c", "host")
    mgr.prefetch(["b"], "host")  # no room: waits
    mgr.unregister("b")  # and is forgotten with its segment: the room freed next brings nothing back
    mgr.release("a")
    assert states(mgr, "a", "c") == [R.HOST, R.HOST] and mgr.pool.in_use == 2 * PAGE  # a was not dropped for b
    mgr.release("c")


def test_a_blocking_fetch_takes_room_from_a_read_ahead_last(make_manager):
    mgr = make_manager(engine="threads", host_budget=2 * PAGE)
    for i, name in enumerate("abc"):
        mgr.register(name, dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(i)).wait()
    use(mgr, "a", "host")
    mgr.prefetch(["b"], "host")
    wait_moves(mgr, "b")
    assert torch.equal(use(mgr, "c", "host"), page(2))  # the room is a's, used before and not asked for again
    assert states(mgr, "a", "b", "c") == [R.NVME, R.HOST, R.HOST]
    assert torch.equal(use(mgr, "b", "host"), page(1)) and mgr.stats.hits == 1


def test_prefetch_along_the_trace_does_not_read_back_a_copy_expected_to_be_overwritten(make_manager):
    mgr = make_manager(engine="threads", host_budget=16 * PAGE, prefetch_bytes=8 * PAGE)
    for i, name in enumerate("abc"):
        mgr.register(name, dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(i)).wait()
    for name in "abc":
        use(mgr, name, "host")
    mgr.end_step()
    for name in "abc":
        mgr.evict(name).wait()
    mgr.expect_overwrite("b")
    assert torch.equal(use(mgr, "a", "host"), page(0))  # the trace says b, then c, come next
    wait_moves(mgr, "c")
    assert states(mgr, "b", "c") == [R.NVME, R.HOST]
    assert torch.equal(use(mgr, "b", "host"), page(1))  # read after all (no overwrite): its bytes


def test_a_read_ahead_writes_back_no_copy_its_user_expects_to_overwrite(make_manager):
    """A dirty copy its user expects to overwrite (a gradient a speculated step consumed, kept until the round is
    validated) is most likely never read: a read-ahead does not write it back to make room; a blocking fetch,
    which must have the room, still does, and its bytes stay the current ones."""
    mgr = make_manager(engine="threads", host_budget=2 * PAGE)
    for i, name in enumerate("gab"):
        mgr.register(name, dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(i)).wait()
    use(mgr, "g", "host", add=10)
    mgr.expect_overwrite("g")
    written = mgr.stats.segment_bytes["host->nvme"]["g"]  # at registration
    mgr.prefetch(["a", "b"], "host")
    wait_moves(mgr, "a", "b")
    assert states(mgr, "g", "a", "b") == [R.HOST, R.HOST, R.NVME]  # no room for b: g stays, unwritten
    assert mgr.stats.segment_bytes["host->nvme"]["g"] == written
    assert torch.equal(use(mgr, "a", "host"), page(1))
    mgr.prefetch([], "host")
    assert torch.equal(use(mgr, "b", "host"), page(2))  # blocking: a (used) goes first, then g if need be
    assert torch.equal(use(mgr, "g", "host"), page(0) + 10)


def test_prefetch_checks_every_name_before_moving_any(make_manager):
    mgr = make_manager(device_budget=4 * PAGE)
    mgr.register("h", dtype=torch.float32, shape=(PAGE // 4,), home="host")
    mgr.register("x", dtype=torch.float32, shape=(PAGE // 4,), home="host")
    mgr.register("d", dtype=torch.float32, shape=(PAGE // 4,), home="device")
    mgr.fetch("x", "host").wait()
    with pytest.raises(IllegalTransitionError, match="'x'.*actual pinned in host"):
        mgr.prefetch(["h", "x"], "device")
    with pytest.raises(IllegalTransitionError, match="'d'.*at or above its home 'device'"):
        mgr.prefetch(["h", "d"], "host")
    with pytest.raises(KeyError, match="nope"):
        mgr.prefetch(["h", "nope"], "device")
    assert states(mgr, "h") == [R.HOST] and mgr.stats.prefetches == 0


def test_a_write_landing_before_its_callback_is_added_starts_no_read_ahead_inside_the_eviction(make_manager):
    """A write-back that a read-ahead's eviction started may be done before its callback is added (a fast disk, a
    buffered write): the callback then runs there, inside the `_fit` walking its victims, and must not read ahead
    from there (that read-ahead evicted the victims still being walked: a host copy gone under it)."""
    mgr = make_manager(engine="threads", host_budget=3 * PAGE, prefetch_bytes=8 * PAGE)
    small, large = [f"d{i}" for i in range(3)], ["e0", "e1"]
    for i, name in enumerate(small):
        mgr.register(name, dtype=torch.float32, shape=(PAGE // 4,), home="nvme", data=page(i)).wait()
    for i, name in enumerate(large):
        mgr.register(name, dtype=torch.float32, shape=(PAGE // 2,), home="nvme",
                     data=torch.full((PAGE // 2,), 5.0 + i)).wait()
    for name in small:
        use(mgr, name, "host", add=10.0)  # three dirty one-page copies fill the budget; e0 needs two of them gone
    write = mgr.store.write

    def landed_at_once(*args, **kwargs):
        handle = write(*args, **kwargs)
        handle.wait(MOVE_TIMEOUT)
        return handle

    mgr.store.write = landed_at_once
    mgr.prefetch(large, "host").wait(MOVE_TIMEOUT)
    for i, name in enumerate(small):
        assert torch.equal(use(mgr, name, "host"), page(i + 10))
    for i, name in enumerate(large):
        assert torch.equal(use(mgr, name, "host"), torch.full((PAGE // 2,), 5.0 + i))
