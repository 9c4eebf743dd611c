"""HostBufferPool: aligned buffers, reused, under a hard budget that raises a typed error with the numbers."""
from __future__ import annotations

import gc
import os
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering import (
    ALIGNMENT,
    BudgetExceededError,
    HostBufferPool,
    HostPoolConfig,
    TieringConfigError,
    align_up,
    aligned_empty,
)
from tiering.errors import fmt_bytes

KiB, MiB = 1 << 10, 1 << 20


def pool(budget: int) -> HostBufferPool:
    return HostBufferPool(HostPoolConfig(budget=budget, pin=False))


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 * MiB + 5])
def test_buffers_are_aligned_and_big_enough(nbytes):
    p = pool(8 * MiB)
    buf = p.acquire(nbytes, "seg")
    assert buf.storage.data_ptr() % ALIGNMENT == 0
    assert buf.tensor.data_ptr() % ALIGNMENT == 0
    assert buf.capacity == align_up(max(nbytes, 1)) and buf.capacity % ALIGNMENT == 0
    assert buf.tensor.numel() == nbytes and buf.tensor.dtype == torch.uint8
    assert p.in_use == buf.capacity and p.held == buf.capacity
    buf.release()
    assert p.in_use == 0 and p.held == align_up(max(nbytes, 1))  # cached, not freed


@pytest.mark.parametrize("nbytes", [0, 1, 4097, 123_457])
def test_aligned_empty(nbytes):
    t = aligned_empty(nbytes)
    assert t.data_ptr() % ALIGNMENT == 0
    assert t.numel() == align_up(max(nbytes, 1)) and t.is_contiguous()
    assert int(t.sum()) == 0  # touched (zeroed) once


def smaps_entry(address: int) -> dict[str, str]:
    """/proc/self/smaps' fields of the mapping holding `address`."""
    entry, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
                start, end = (int(x, 16) for x in head.split("-"))
                if inside:
                    break
                inside = start <= address < end
            elif inside:
                key, _, value = line.partition(":")
                entry[key] = value.strip()
    return entry


def thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


@pytest.mark.skipif(thp_mode() in (None, "never"), reason="no transparent huge pages on this kernel")
def test_large_buffers_may_use_huge_pages_and_small_ones_are_not_asked_to():
    """Huge pages keep an O_DIRECT block physically contiguous, so the device gets large requests (aligned.py)."""
    large, small = aligned_empty(16 * MiB), aligned_empty(64 * KiB)
    assert smaps_entry(large.data_ptr()).get("THPeligible") == "1"
    assert "hg" in smaps_entry(large.data_ptr()).get("VmFlags", "").split()  # MADV_HUGEPAGE
    assert "hg" not in smaps_entry(small.data_ptr()).get("VmFlags", "").split()
    assert int(large.sum()) == 0 and int(small.sum()) == 0


def test_budget_is_hard_and_the_error_carries_the_numbers():
    p = pool(1 * MiB)
    held = p.acquire(768 * KiB, "layers.6/shard0")
    with pytest.raises(BudgetExceededError) as info:
        p.acquire(512 * KiB, "layers.7/shard0")
    err = info.value
    assert (err.tier, err.budget, err.in_use, err.requested) == ("host", 1 * MiB, 768 * KiB, 512 * KiB)
    assert err.what == "layers.7/shard0"
    message = str(err)
    for text in ("host", fmt_bytes(MiB), fmt_bytes(768 * KiB), fmt_bytes(512 * KiB), "layers.7/shard0"):
        assert text in message, f"{text!r} missing from {message!r}"
    assert isinstance(err, MemoryError)
    # Nothing changed; the rest still fits exactly.
    assert p.in_use == 768 * KiB and p.held == 768 * KiB
    rest = p.acquire(256 * KiB)
    assert p.in_use == p.budget
    with pytest.raises(BudgetExceededError):
        p.acquire(1)
    held.release()
    rest.release()


def test_memory_the_machine_cannot_give_leaves_the_books_as_they_were():
    """A buffer whose memory cannot be had (64 TiB, more than any machine here) fails with the allocator's error
    and its count is given back once, whether it was made at once or later by `make()` and released."""
    p = HostBufferPool(HostPoolConfig(budget=1 << 50, pin=False, arena=False))
    with pytest.raises(OSError):  # ENOMEM
        p.acquire(1 << 46, "huge")
    assert p.in_use == 0 and p.held == 0
    unmade = p.acquire(1 << 46, "huge later", unmade=True)
    assert p.in_use == 1 << 46
    with pytest.raises(OSError):
        unmade.make()
    unmade.release()
    assert p.in_use == 0 and p.held == 0
    small = p.acquire(4 * KiB)  # the pool still works
    assert p.in_use == 4 * KiB
    small.release()


def test_requested_is_the_rounded_size_it_would_take():
    p = pool(8 * KiB)
    with pytest.raises(BudgetExceededError) as info:
        p.acquire(8 * KiB + 1, "odd")
    assert info.value.requested == 12 * KiB and info.value.in_use == 0


def test_zero_budget_refuses_everything():
    with pytest.raises(BudgetExceededError):
        pool(0).acquire(0)


def test_reuse_does_not_allocate_again():
    p = pool(16 * MiB)
    sizes = [4096, 1 * MiB, 5000, 3 * MiB + 1, 0]
    for _ in range(20):
        bufs = [p.acquire(n) for n in sizes]
        for b in bufs:
            b.release()
    assert p.allocations == len(sizes)
    assert p.held == p.fresh_bytes == sum(align_up(max(n, 1)) for n in sizes)
    assert p.in_use == 0
    assert p.peak_in_use == p.held


def test_reuse_gives_back_the_same_memory():
    p = pool(1 * MiB)
    b = p.acquire(64 * KiB)
    address = b.storage.data_ptr()
    b.release()
    c = p.acquire(60 * KiB)  # fits in the cached 64 KiB buffer
    assert c.storage.data_ptr() == address and p.allocations == 1
    assert c.tensor.numel() == 60 * KiB and c.capacity == 64 * KiB
    c.release()


def test_smallest_cached_buffer_that_fits_is_reused_if_at_most_twice_the_request():
    p = pool(4 * MiB)
    small, big = p.acquire(64 * KiB), p.acquire(1 * MiB)
    small_addr, big_addr = small.storage.data_ptr(), big.storage.data_ptr()
    big.release()
    small.release()
    assert p.acquire(32 * KiB).storage.data_ptr() == small_addr
    assert p.acquire(512 * KiB).storage.data_ptr() == big_addr
    assert p.allocations == 2
    tiny = p.acquire(16 * KiB)  # the cached buffers (none left) or a new one: never a 1 MiB one for 16 KiB
    assert tiny.capacity == 16 * KiB and p.allocations == 3
    tiny.release()
    p.acquire(4 * KiB)  # the cached 16 KiB buffer is four times that: a new one, the budget counts 4 KiB
    assert p.allocations == 4 and p.in_use == 64 * KiB + 1 * MiB + 4 * KiB


def test_cached_buffers_lend_their_excess_only_within_the_spare():
    """`spare` (the engine's budget less its least host budget) bounds what lent cached buffers hold beyond their
    requests: past it a request gets a new buffer of its own size."""
    p = pool(1 * MiB)
    p.spare = 16 * KiB
    a, b = p.acquire(128 * KiB), p.acquire(128 * KiB)
    a.release()
    b.release()
    c = p.acquire(112 * KiB)  # a cached 128 KiB buffer, 16 KiB over: within the spare
    assert c.capacity == 128 * KiB and p.allocations == 2
    d = p.acquire(120 * KiB)  # the other one would be 8 KiB more over: a new buffer of 120 KiB
    assert d.capacity == 120 * KiB and p.allocations == 3 and p.in_use == 248 * KiB
    c.release()
    e = p.acquire(120 * KiB)  # c's 16 KiB given back: the cached buffer, 8 KiB over
    assert e.capacity == 128 * KiB and p.allocations == 3


def test_cached_buffers_are_dropped_to_make_room():
    p = pool(1 * MiB)
    for _ in range(4):
        p.acquire(256 * KiB).release()  # one 256 KiB buffer, reused
    a = p.acquire(256 * KiB)
    b = p.acquire(256 * KiB)
    a.release()
    b.release()
    assert p.held == 512 * KiB and p.in_use == 0
    big = p.acquire(1 * MiB)  # fits only once both cached buffers are dropped
    assert p.held == 1 * MiB and p.in_use == 1 * MiB
    assert p.allocations == 3
    big.release()
    # The budget counts cached buffers too: held never exceeds it.
    assert p.held <= p.budget


def test_trim_gives_back_cached_memory():
    p = pool(1 * MiB)
    a, b = p.acquire(4096), p.acquire(8192)
    a.release()
    assert p.trim() == 4096
    assert p.held == 8192 and p.in_use == 8192
    b.release()


def test_double_release_raises():
    p = pool(1 * MiB)
    b = p.acquire(100, "seg.a")
    b.release()
    with pytest.raises(RuntimeError, match="seg.a"):
        b.release()
    assert p.in_use == 0 and p.held == 4096
    # The pool is not corrupted: the buffer is cached once, not twice.
    x, y = p.acquire(100), p.acquire(100)
    assert x.storage.data_ptr() != y.storage.data_ptr()
    assert p.allocations == 2


def test_context_manager_releases():
    p = pool(1 * MiB)
    with p.acquire(4096) as buf:
        assert p.in_use == 4096
        buf.tensor.fill_(7)
    assert p.in_use == 0


def test_view_is_a_no_copy_typed_window():
    p = pool(1 * MiB)
    buf = p.acquire(3 * 5 * 8)
    v = buf.view(torch.float64, (3, 5))
    assert v.shape == (3, 5) and v.data_ptr() == buf.storage.data_ptr()
    v.fill_(2.5)
    assert torch.equal(buf.tensor[:8], torch.tensor([2.5], dtype=torch.float64).view(torch.uint8))
    assert buf.view(torch.bfloat16, (0, 4)).numel() == 0
    buf.release()


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 300 * KiB)), max_size=40),
       spare=st.none() | st.integers(0, 256 * KiB))
def test_accounting_invariants(ops, spare):
    budget = 1 * MiB
    p = pool(budget)
    p.spare = spare
    live = []
    for acquire, n in ops:
        if acquire or not live:
            want = align_up(max(n, 1))
            try:
                b = p.acquire(n)
            except BudgetExceededError as e:
                assert e.in_use + e.requested > budget and e.requested == want
                continue
            assert b.storage.data_ptr() % ALIGNMENT == 0 and b.capacity >= want
            live.append(b)
        else:
            live.pop(n % len(live)).release()
        assert p.in_use == sum(b.capacity for b in live)
        assert p.in_use <= p.held <= budget
        if spare is not None:  # what cached buffers lend beyond the requests
            assert sum(b.capacity - align_up(max(b.nbytes, 1)) for b in live) <= spare
    starts = sorted((b.storage.data_ptr(), b.capacity) for b in live)
    for (a, alen), (b, _) in zip(starts, starts[1:]):
        assert a + alen <= b, "two live buffers share memory"


def test_concurrent_acquire_release_keeps_the_books():
    p = pool(2 * MiB)
    errors = []

    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        try:
            for _ in range(200):
                n = int(torch.randint(1, 64 * KiB, (1,), generator=g))
                try:
                    b = p.acquire(n)
                except BudgetExceededError:
                    continue
                b.tensor[:1] = seed
                b.release()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert p.in_use == 0 and p.held <= p.budget


@pytest.mark.parametrize("budget", [-1, 1.5, "1GiB"])
def test_bad_budget_is_a_config_error(budget):
    with pytest.raises(TieringConfigError, match="budget"):
        HostPoolConfig(budget=budget)


def mapped(address: int) -> bool:
    """Whether `address` lies in one of this process's memory mappings."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc")
def test_a_dropped_buffer_leaves_the_process():
    """A buffer the pool drops is unmapped, not kept by malloc's heap (which would count in RSS beyond every
    budget): many 16 MiB buffers allocated and dropped in turn, each gone when its tensor dies."""
    for _ in range(8):
        buffer = aligned_empty(16 * MiB)
        address = buffer.data_ptr()
        assert mapped(address)
        del buffer
        gc.collect()
        assert not mapped(address), "a dropped host buffer is still mapped"


def test_an_unmade_buffer_counts_its_bytes_and_allocates_only_when_made():
    """A buffer lent unmade (the swap manager's reads and staging: made off its lock) is counted against the budget
    at once; released unmade it gives its count back and caches nothing; a cached buffer that fits is lent made."""
    p = pool(1 * MiB)
    b = p.acquire(300 * KiB, "a read", unmade=True)
    assert b.storage is None and b.capacity == 300 * KiB and p.in_use == p.held == 300 * KiB
    with pytest.raises(BudgetExceededError):
        p.acquire(800 * KiB, unmade=True)  # the unmade bytes count
    b.make()
    assert b.storage is not None and b.storage.data_ptr() % 4096 == 0 and p.allocations == 1
    b.release()
    again = p.acquire(300 * KiB, unmade=True)  # from the cache: made already
    assert again.storage is not None and again.unmade == 0
    again.release()
    never = p.acquire(600 * KiB, unmade=True)
    held = p.held
    never.release()  # never made: nothing to cache
    assert p.in_use == 0 and p.held == held - 600 * KiB
    with pytest.raises(RuntimeError, match="released twice"):
        never.release()
