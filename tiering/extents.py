"""Extent allocator for one store file: 4 KiB-aligned ranges, best fit, neighbours coalesced on free."""
from __future__ import annotations

import bisect
from typing import NamedTuple

from .aligned import ALIGNMENT, align_up


class Extent(NamedTuple):
    """A range of a store file: `offset` and `length` are multiples of 4 KiB; `file` is which of the store's
    files (one per nvme directory, in the order given) holds it."""

    offset: int
    length: int
    file: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.length


class ExtentAllocator:
    """Hands out non-overlapping extents of a file of `capacity` bytes that can grow at its end.

    Free ranges are kept sorted by offset and merged with their neighbours on free, so freeing everything
    always leaves one range; allocation takes the smallest range that fits (best fit), which keeps large
    ranges whole for large segments.
    """

    def __init__(self, capacity: int = 0):
        if capacity % ALIGNMENT:
            raise ValueError(f"capacity {capacity} is not a multiple of {ALIGNMENT}")
        self._capacity = capacity
        self._free_offsets: list[int] = [0] if capacity else []
        self._free_lengths: dict[int, int] = {0: capacity} if capacity else {}
        self._used: dict[int, int] = {}
        self._used_bytes = 0  # kept as a count: a striped store compares its files' use on every allocation

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        return self._capacity - self.used_bytes

    def largest_free(self) -> int:
        return max(self._free_lengths.values(), default=0)

    def tail_free(self) -> int:
        """Bytes free at the end of the file: growing by `need - tail_free()` makes room for `need`."""
        tail = self._tail_free_offset(self._capacity)
        return 0 if tail is None else self._free_lengths[tail]

    def allocate(self, nbytes: int) -> Extent | None:
        """An extent of at least `nbytes` (rounded up to 4 KiB), or None if no free range holds it."""
        length = align_up(max(nbytes, 1))
        best = None
        for offset in self._free_offsets:
            size = self._free_lengths[offset]
            if size >= length and (best is None or size < self._free_lengths[best]):
                best = offset
                if size == length:
                    break
        if best is None:
            return None
        size = self._free_lengths.pop(best)
        self._free_offsets.remove(best)
        if size > length:
            self._insert_free(best + length, size - length)
        self._used[best] = length
        self._used_bytes += length
        return Extent(best, length)

    def free(self, extent: Extent) -> None:
        if self._used.get(extent.offset) != extent.length:
            raise ValueError(f"{extent} is not an allocated extent of this store")
        del self._used[extent.offset]
        offset, length = extent.offset, extent.length
        self._used_bytes -= length
        i = bisect.bisect_left(self._free_offsets, offset)
        if i < len(self._free_offsets) and self._free_offsets[i] == offset + length:
            length += self._free_lengths.pop(self._free_offsets.pop(i))
        if i > 0:
            prev = self._free_offsets[i - 1]
            if prev + self._free_lengths[prev] == offset:
                self._free_lengths[prev] += length
                return
        self._insert_free(offset, length)

    def grow(self, new_capacity: int) -> None:
        """Add [capacity, new_capacity) as free space, merged with a free range that ends at the old end."""
        if new_capacity % ALIGNMENT or new_capacity < self._capacity:
            raise ValueError(f"cannot grow from {self._capacity} to {new_capacity}")
        added, start = new_capacity - self._capacity, self._capacity
        self._capacity = new_capacity
        if not added:
            return
        tail = self._tail_free_offset(start)
        if tail is not None:
            self._free_lengths[tail] += added
        else:
            self._insert_free(start, added)

    def _tail_free_offset(self, end: int) -> int | None:
        """Offset of the free range that ends at `end`, if there is one."""
        if self._free_offsets:
            last = self._free_offsets[-1]
            if last + self._free_lengths[last] == end:
                return last
        return None

    def _insert_free(self, offset: int, length: int) -> None:
        bisect.insort(self._free_offsets, offset)
        self._free_lengths[offset] = length
