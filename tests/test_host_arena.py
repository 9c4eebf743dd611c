"""The host pool's arena: a freed large buffer's frames serve later requests of any size without new page faults
(they move), the physical memory it holds is what its books say and never above the budget, and lent runs never
share or lose bytes."""
from __future__ import annotations

import os
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering import BudgetExceededError, HostBufferPool, HostPoolConfig, align_up
from tiering.host_arena import FRAME

MiB = 1 << 20
pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="counts pages with Linux's /proc")


def pool(budget: int) -> HostBufferPool:
    p = HostBufferPool(HostPoolConfig(budget=budget, pin=False, arena=True))
    assert p.arena is not None
    return p


def resident(p: HostBufferPool) -> int:
    """Bytes resident in the arena's address range (/proc/self/smaps, summed over the mappings inside it)."""
    start, end = p.arena.base, p.arena.base + p.arena.frames * FRAME
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and hi > start
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def test_a_freed_large_buffer_serves_smaller_ones_and_a_larger_one_again_by_moving_its_frames():
    """The churn this replaces: a 48 MiB shard freed, eight state parts of 6 MiB, then a shard of 56 MiB."""
    p = pool(64 * MiB)
    shard = p.acquire(48 * MiB, "blocks.0/param")
    shard.tensor.fill_(7)
    shard.release()
    allocations = p.allocations
    parts = [p.acquire(6 * MiB, f"blocks.0/{i}/exp_avg") for i in range(8)]
    assert p.allocations == allocations and p.held == 48 * MiB  # every part's frames were the shard's
    assert all(bool((part.tensor == 7).all()) for part in parts)  # the shard's pages, not fresh ones
    for part in parts:
        part.release()
    moved, fresh = p.arena.moved, p.fresh_bytes
    again = p.acquire(56 * MiB, "blocks.1/param")
    assert p.arena.moved - moved == 24 and p.held == 56 * MiB  # 24 frames moved, only 4 faulted in
    assert p.fresh_bytes - fresh == 8 * MiB
    assert resident(p) == p.held
    again.release()


def test_pages_resident_are_the_books_and_the_budget_holds_them():
    p = pool(40 * MiB)
    big = p.acquire(30 * MiB + 4096)  # a partial last frame: on small pages, populated only as far as it reaches
    assert resident(p) == p.held == 30 * MiB + 4096
    big.release()
    small = [p.acquire(5 * MiB + 8192) for _ in range(3)]
    assert p.held <= p.budget and resident(p) == p.held
    other = p.acquire(20 * MiB)  # needs room: free frames given back
    assert p.held <= p.budget and resident(p) == p.held
    for buffer in small + [other]:
        buffer.release()
    assert p.trim() > 0 and p.held == 0 and resident(p) == 0


def test_an_unmade_arena_buffer_faults_its_pages_only_when_made_and_released_unmade_counts_nothing():
    p = pool(32 * MiB)
    buffer = p.acquire(8 * MiB, "x", unmade=True)
    assert not buffer.made and p.held == 8 * MiB and resident(p) == 0
    buffer.make()
    assert buffer.made and resident(p) == 8 * MiB
    buffer.release()
    never = p.acquire(12 * MiB, "y", unmade=True)  # 8 MiB moved or in place, 4 MiB to fault in
    never.release()
    assert p.held == resident(p) == 8 * MiB


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(2 * MiB, 24 * MiB)), max_size=30))
def test_books_pages_and_contents_hold_under_any_order(ops):
    """Random acquires and releases of large buffers: in use <= held <= budget, the resident pages equal held,
    live buffers never overlap, and each keeps the bytes written into it through the others' churn."""
    budget = 64 * MiB
    p = pool(budget)
    live: list[tuple[object, int]] = []
    for step, (acquire, n) in enumerate(ops):
        if acquire or not live:
            try:
                buffer = p.acquire(n)
            except BudgetExceededError as e:
                assert e.in_use + e.requested > budget and e.requested == align_up(n)
                continue
            buffer.tensor.fill_(step % 251)
            live.append((buffer, step % 251))
        else:
            buffer, _ = live.pop(n % len(live))
            buffer.release()
        assert p.in_use == sum(b.capacity for b, _ in live) <= p.held <= budget
        assert resident(p) == p.held - p._held
    spans = sorted((b.storage.data_ptr(), b.capacity) for b, _ in live)
    for (a, length), (b, _) in zip(spans, spans[1:]):
        assert a + length <= b, "two live buffers share memory"
    for buffer, value in live:
        assert bool((buffer.tensor == value).all()), "a live buffer lost its bytes"
        buffer.release()
    assert p.in_use == 0


class _Refusing:
    """libc whose mremap fails as a kernel before 5.7 answers MREMAP_DONTUNMAP (MAP_FAILED, EINVAL)."""

    def __init__(self, libc):
        self.mmap = libc.mmap

    @staticmethod
    def mremap(*args):
        return 2**64 - 1


def test_a_kernel_that_refuses_moves_gets_frames_faulted_in_with_the_books_exact(monkeypatch):
    from tiering import host_arena

    monkeypatch.setattr(host_arena, "LIBC", _Refusing(host_arena.LIBC))
    p = pool(64 * MiB)
    shard = p.acquire(48 * MiB)
    shard.release()
    parts = [p.acquire(6 * MiB) for _ in range(8)]  # in place: nothing to move
    for part in parts:
        part.tensor.fill_(3)
        part.release()
    big = p.acquire(56 * MiB)  # would move 24 frames: the first refusal turns moves off, the rest are faulted
    big.tensor.fill_(5)
    assert p.arena.moved == 0 and not p.arena._moves
    assert p.in_use == 56 * MiB and p.held <= p.budget and resident(p) == p.held  # free frames kept up to the budget
    assert bool((big.tensor == 5).all())
    big.release()


def test_threads_lending_and_making_at_once_keep_books_and_bytes():
    """The swap manager's threads acquire unmade buffers under its lock and make them outside it."""
    budget = 96 * MiB
    p = pool(budget)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for i in range(40):
                n = (2 + (seed * 7 + i * 5) % 10) * MiB + (i % 3) * 4096
                buffer = p.acquire(n, unmade=True)
                buffer.make()
                buffer.tensor.fill_(seed)
                assert bool((buffer.tensor == seed).all())
                buffer.release()
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(1, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert p.in_use == 0 and p.held <= budget and resident(p) == p.held


def test_a_request_no_free_run_fits_gets_a_whole_buffer_and_the_arena_gives_back_room(monkeypatch):
    p = pool(32 * MiB)
    shard = p.acquire(24 * MiB)
    shard.release()  # 24 MiB of free frames kept
    monkeypatch.setattr(p.arena, "place", lambda size: None)  # the address space cut up: no run long enough
    whole = p.acquire(16 * MiB)
    assert not p.arena.owns(whole.storage) and whole.capacity == 16 * MiB
    assert p.held <= p.budget and resident(p) == p.held - 16 * MiB == 16 * MiB  # 8 MiB of frames given back
    storage = whole.storage
    whole.release()
    again = p.acquire(12 * MiB)  # the cached whole buffer serves it (at most twice its size)
    assert again.storage.data_ptr() == storage.data_ptr() and p.held <= p.budget
