"""Extent allocator: checked against a model that knows only which extents are in use.

The free space the allocator must see is the gaps between used extents in [0, capacity); from those the model
predicts best fit (the smallest gap that holds the request), None exactly when no gap holds it, largest_free()
(which is only right if free neighbours were coalesced) and tail_free().
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from tiering import ALIGNMENT, Extent, ExtentAllocator, align_up

PAGE = ALIGNMENT


def gaps(used: dict[int, int], capacity: int) -> list[tuple[int, int]]:
    """Free (offset, length) ranges between the used extents, sorted by offset, maximal."""
    out, cursor = [], 0
    for offset in sorted(used):
        if offset > cursor:
            out.append((cursor, offset - cursor))
        cursor = offset + used[offset]
    if capacity > cursor:
        out.append((cursor, capacity - cursor))
    return out


class ExtentMachine(RuleBasedStateMachine):
    extents = Bundle("extents")

    def __init__(self):
        super().__init__()
        self.alloc = ExtentAllocator(0)
        self.used: dict[int, int] = {}  # the model: offset -> length of extents handed out

    @rule(pages=st.integers(0, 64))
    def grow(self, pages):
        new = self.alloc.capacity + pages * PAGE
        self.alloc.grow(new)
        assert self.alloc.capacity == new

    @rule(target=extents, nbytes=st.one_of(st.integers(0, 40 * PAGE), st.sampled_from([1, PAGE - 1, PAGE, PAGE + 1])))
    def allocate(self, nbytes):
        length = align_up(max(nbytes, 1))
        fitting = [(size, off) for off, size in gaps(self.used, self.alloc.capacity) if size >= length]
        extent = self.alloc.allocate(nbytes)
        if not fitting:
            assert extent is None, f"allocated {extent} though no free range holds {length} bytes"
            return None
        assert extent is not None, f"no extent for {length} bytes though free ranges {fitting} hold it"
        assert extent.length == length
        best = min(size for size, _ in fitting)
        assert any(off == extent.offset and size == best for size, off in fitting), (
            f"{extent} is not at the start of a smallest fitting free range (best fit {best}, free {fitting})"
        )
        self.used[extent.offset] = extent.length
        return extent

    @rule(extent=consumes(extents))
    def free(self, extent):
        if extent is None:
            return
        self.alloc.free(extent)
        del self.used[extent.offset]

    @precondition(lambda self: self.used)
    @rule(data=st.data())
    def free_twice_is_refused(self, data):
        offset = data.draw(st.sampled_from(sorted(self.used)))
        bogus = Extent(offset, self.used[offset] + PAGE)  # wrong length: not an extent of this allocator
        with pytest.raises(ValueError):
            self.alloc.free(bogus)

    @invariant()
    def extents_are_aligned_disjoint_and_inside(self):
        capacity = self.alloc.capacity
        assert capacity % PAGE == 0
        end = 0
        for offset in sorted(self.used):
            length = self.used[offset]
            assert offset % PAGE == 0 and length % PAGE == 0 and length > 0
            assert offset >= end, f"extent at {offset} overlaps the one ending at {end}"
            end = offset + length
            assert end <= capacity

    @invariant()
    def accounting_matches_the_model(self):
        free = gaps(self.used, self.alloc.capacity)
        assert self.alloc.used_bytes == sum(self.used.values())
        assert self.alloc.free_bytes == sum(size for _, size in free)
        # Uncoalesced neighbours would make the largest free range smaller than the largest gap.
        assert self.alloc.largest_free() == max((size for _, size in free), default=0)
        tail = free[-1][1] if free and sum(free[-1]) == self.alloc.capacity else 0
        assert self.alloc.tail_free() == tail

    def teardown(self):
        for offset, length in list(self.used.items()):
            self.alloc.free(Extent(offset, length))
        self.used.clear()
        capacity = self.alloc.capacity
        assert self.alloc.largest_free() == capacity, "freeing everything must coalesce to one free range"
        assert self.alloc.used_bytes == 0 and self.alloc.free_bytes == capacity
        if capacity:
            assert self.alloc.allocate(capacity) == Extent(0, capacity)


TestExtentMachine = ExtentMachine.TestCase
TestExtentMachine.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 16 * PAGE), min_size=1, max_size=30), seed=st.randoms())
def test_free_all_in_any_order_coalesces_to_one_range(sizes, seed):
    capacity = sum(align_up(s) for s in sizes)
    alloc = ExtentAllocator(capacity)
    extents = [alloc.allocate(s) for s in sizes]
    assert all(e is not None for e in extents)
    assert alloc.allocate(1) is None  # exactly full
    seed.shuffle(extents)
    for e in extents:
        alloc.free(e)
    assert alloc.largest_free() == capacity == alloc.free_bytes


def test_best_fit_reuses_the_hole_that_fits():
    alloc = ExtentAllocator(0)
    alloc.grow(64 * PAGE)
    a = alloc.allocate(8 * PAGE)
    b = alloc.allocate(2 * PAGE)
    c = alloc.allocate(4 * PAGE)
    d = alloc.allocate(PAGE)
    alloc.free(a)  # hole of 8 pages at 0
    alloc.free(c)  # hole of 4 pages after b
    e = alloc.allocate(3 * PAGE + 1)  # 4 pages: the 4-page hole fits best, not the 8-page one or the tail
    assert e == Extent(c.offset, 4 * PAGE)
    f = alloc.allocate(8 * PAGE)
    assert f == Extent(a.offset, 8 * PAGE)
    assert alloc.largest_free() == 64 * PAGE - d.end


def test_zero_bytes_take_one_page_and_odd_sizes_round_up():
    alloc = ExtentAllocator(4 * PAGE)
    assert alloc.allocate(0) == Extent(0, PAGE)
    assert alloc.allocate(PAGE + 1) == Extent(PAGE, 2 * PAGE)
    assert alloc.allocate(2 * PAGE) is None
    assert alloc.allocate(PAGE).end == 4 * PAGE


def test_grow_merges_with_a_free_tail():
    alloc = ExtentAllocator(4 * PAGE)
    a = alloc.allocate(PAGE)
    alloc.grow(8 * PAGE)
    assert alloc.largest_free() == 7 * PAGE == alloc.tail_free()
    assert alloc.allocate(7 * PAGE) == Extent(a.end, 7 * PAGE)
    assert alloc.tail_free() == 0
    alloc.grow(10 * PAGE)
    assert alloc.tail_free() == 2 * PAGE


@pytest.mark.parametrize("capacity", [1, PAGE + 1])
def test_unaligned_capacity_is_refused(capacity):
    with pytest.raises(ValueError):
        ExtentAllocator(capacity)
    alloc = ExtentAllocator(PAGE)
    with pytest.raises(ValueError):
        alloc.grow(PAGE + capacity)


def test_cannot_shrink_or_free_foreign_extents():
    alloc = ExtentAllocator(4 * PAGE)
    with pytest.raises(ValueError):
        alloc.grow(2 * PAGE)
    e = alloc.allocate(PAGE)
    with pytest.raises(ValueError):
        alloc.free(Extent(e.offset + PAGE, PAGE))
    alloc.free(e)
    with pytest.raises(ValueError):
        alloc.free(e)  # double free
