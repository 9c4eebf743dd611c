"""HostArena: the host pool's large buffers as runs of 2 MiB frames in one reserved address range; a freed frame
is moved (mremap) to wherever the next buffer needs it, whatever that buffer's size.

Why: a step's host buffers come in sizes that take turns (a unit's parameter shard of 100-400 MB in the forward,
state parts and gradients of 8-16 MB in the backward and the step). A pool of whole buffers under a byte budget
cannot serve a 16 MB request from a freed 200 MB buffer, so it unmapped cached buffers and faulted fresh ones in:
1.1-2.1 GB a step at 1b x 4 layers with a 1 GiB budget, and a stand-in that kept them (over the budget) stepped
5-15% faster (bench/RESULTS.md, session 30). Placing freed ranges in place was tried (session 23): a large buffer
rarely finds a free run whose pages are still there. Moving a frame's page table entry costs ~15 us (a huge page
moves as one entry); faulting its 2 MiB in costs ~10x that and more when the cores are busy.

Physical memory is counted exactly: a run starts on a frame boundary, its whole frames are huge pages (an O_DIRECT
request stays physically contiguous, aligned.py), and its last, partial frame is kept on 4 KiB pages and populated
only as far as the run reaches. Whole frames move into whole frames; a last frame takes the free partial frame that
fits it best (trimmed or topped up); the budget gives back partial frames first.
Unpinned memory only: a pinned range is registered with CUDA by address, and moving its pages would break that.
"""
from __future__ import annotations

import bisect
import ctypes
import mmap

import torch

from .aligned import HUGE_PAGE

FRAME = HUGE_PAGE
MAP_NORESERVE = 0x4000
"""Linux's flag (Python's mmap does not name it): the reserve is address space, not committed memory."""
MAP_FIXED_NOREPLACE = 0x100000
MREMAP_MAYMOVE, MREMAP_FIXED, MREMAP_DONTUNMAP = 1, 2, 4
"""MREMAP_DONTUNMAP (Linux 5.7) leaves the source mapped, empty: the reserve never has a hole another mapping
could take."""


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mremap.restype = libc.mmap.restype = ctypes.c_void_p
        libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        return libc
    except (OSError, AttributeError):
        return None


LIBC = _libc()


def max_frames() -> int:
    """The most frames an arena may have: every frame boundary can become a mapping boundary once frames move and
    are advised (nothing splits a frame), and the kernel caps a process's mappings (vm.max_map_count): an arena
    takes at most a quarter of that."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read()) // 4
    except (OSError, ValueError):
        return 16382


class HostArena:
    """Frames of one private anonymous mapping of `capacity` bytes (rounded up to frames). Not thread-safe: the
    pool calls it under its lock; `touch` (the page faults) runs outside it, on ranges already lent."""

    def __init__(self, capacity: int):
        self.frames = -(-capacity // FRAME)
        self._map = mmap.mmap(-1, (self.frames + 1) * FRAME,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        self._skip = -whole.data_ptr() % FRAME  # the first frame boundary inside the mapping
        self.tensor = whole[self._skip: self._skip + self.frames * FRAME]
        self.base = self.tensor.data_ptr()
        self._map.madvise(mmap.MADV_HUGEPAGE, self._skip, self.frames * FRAME)
        self._free: list[list[int]] = [[0, self.frames]]  # [start, end) in frames, sorted, coalesced
        self._filled = [0] * self.frames  # bytes populated from each frame's start
        self._small = [False] * self.frames  # advised MADV_NOHUGEPAGE (a partial last frame)
        self._spare: set[int] = set()  # free frames fully populated: what a whole frame's move takes
        self._partial: set[int] = set()  # free frames partly populated: what a last frame's move takes
        self._lent: dict[int, int] = {}  # start frame -> bytes lent
        self._moves = LIBC is not None
        """Whether frames move (False once the kernel refused a move: they are faulted in from then on)."""
        self.populated = 0
        """Bytes of physical memory the arena holds: every lent byte, and what free frames keep for reuse."""
        self.moved = 0
        """Frames moved so far rather than faulted in."""

    def owns(self, tensor: torch.Tensor) -> bool:
        return 0 <= tensor.data_ptr() - self.base < self.frames * FRAME

    def place(self, size: int) -> int | None:
        """Where a run of `size` bytes goes (its start frame; None: no free run is long enough): the first free run
        that fits, from the top for large runs (a sixteenth of the arena or more), from the bottom for the rest,
        so that small runs do not cut up the room a large one needs."""
        count = -(-size // FRAME)
        top = count * 16 >= self.frames
        for start, end in (reversed(self._free) if top else self._free):
            if end - start >= count:
                return end - count if top else start
        return None

    def lend(self, start: int, size: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Lend `size` bytes at frame `start` (from `place`): spare frames move into its whole frames not yet
        populated, the partial frame that fits best into its last. Returns the view and the byte spans to fault
        in (`touch`); `populated` counts them already (the pool gives back free frames if that passes its budget,
        before anything is touched)."""
        count = -(-size // FRAME)
        self._take(start, count)
        spans: list[tuple[int, int]] = []
        whole = range(start, start + size // FRAME)
        donors = sorted(self._spare)  # taken from the top: the runs lent from the bottom keep theirs
        for frame in sorted((f for f in whole if self._filled[f] < FRAME), key=self._filled.__getitem__):
            if not (donors and self._move(donors.pop(), frame)):
                spans += self._fill(frame, FRAME)
        if size % FRAME:
            last, want = start + count - 1, size % FRAME
            source = self._last_source(want) if self._filled[last] < want else None
            if source is not None and self._filled[source] > self._filled[last]:
                self._move(source, last)
            spans += self._fill(last, want)
        self._lent[start] = size
        return self.tensor[start * FRAME: start * FRAME + size], spans

    def _last_source(self, want: int) -> int | None:
        """The free frame to move into a last frame of `want` bytes: the partial one holding the fewest bytes at
        least `want` (trimmed after), else the fullest partial one (topped up), else a spare."""
        enough = [f for f in self._partial if self._filled[f] >= want]
        if enough:
            return min(enough, key=self._filled.__getitem__)
        if self._partial:
            return max(self._partial, key=self._filled.__getitem__)
        return max(self._spare) if self._spare else None

    def _take(self, start: int, count: int) -> None:
        index = bisect.bisect_right(self._free, [start, self.frames + 1]) - 1
        run = self._free[index]
        if run[1] > start + count:
            self._free.insert(index + 1, [start + count, run[1]])
        run[1] = start
        if run[0] == run[1]:
            self._free.pop(index)
        self._spare.difference_update(range(start, start + count))
        self._partial.difference_update(range(start, start + count))

    def _move(self, source: int, frame: int) -> bool:
        """Move free frame `source`'s pages to `frame` (whose own pages go); False where the kernel would not."""
        if not self._moves:
            return False
        self._drop(frame, 0)
        address = self.base + frame * FRAME
        moved = LIBC.mremap(self.base + source * FRAME, FRAME, FRAME,
                            MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, address)
        if moved != address:  # e.g. a kernel before 5.7: frames are faulted in from now on
            self._moves = False
            LIBC.mmap(address, FRAME, mmap.PROT_READ | mmap.PROT_WRITE,  # where the refusal left a hole
                      mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0)
            self._small[frame] = True
            return False
        self._spare.discard(source)
        self._partial.discard(source)
        self._filled[frame], self._filled[source] = self._filled[source], 0
        self._small[frame] = self._small[source]  # the advice travels with the pages
        self.moved += 1
        return True

    def _fill(self, frame: int, want: int) -> list[tuple[int, int]]:
        """Make `frame` hold exactly its first `want` bytes: trim what is beyond, return the span to fault in."""
        self._advise(frame, huge=want == FRAME)
        have = self._filled[frame]
        if have >= want:
            self._drop(frame, want)
            return []
        self.populated += want - have
        self._filled[frame] = want
        return [(frame * FRAME + have, frame * FRAME + want)]

    def _advise(self, frame: int, *, huge: bool) -> None:
        if huge == self._small[frame]:
            self._map.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE, self._skip + frame * FRAME, FRAME)
            self._small[frame] = not huge

    def touch(self, spans: list[tuple[int, int]]) -> None:
        """Fault in the spans `lend` returned (zeroing them), once, here rather than in the middle of a copy."""
        for begin, end in spans:
            self.tensor[begin:end].zero_()

    def give_back(self, tensor: torch.Tensor, untouched: list[tuple[int, int]] | None = None) -> int:
        """Take back a lent run; its pages stay for reuse (`untouched`: spans `lend` returned that were never
        faulted in, no longer counted). Returns its size."""
        start = (tensor.data_ptr() - self.base) // FRAME
        size = self._lent.pop(start)
        for begin, end in untouched or ():
            self._filled[begin // FRAME] = begin % FRAME
            self.populated -= end - begin
        count = -(-size // FRAME)
        for frame in range(start, start + count):
            if self._filled[frame] == FRAME:
                self._spare.add(frame)
            elif self._filled[frame]:
                self._partial.add(frame)
        run = [start, start + count]
        index = bisect.bisect_left(self._free, run)
        if index < len(self._free) and self._free[index][0] == run[1]:
            run[1] = self._free.pop(index)[1]
        if index > 0 and self._free[index - 1][1] == run[0]:
            self._free[index - 1][1] = run[1]
        else:
            self._free.insert(index, run)
        return size

    def shed(self, nbytes: int) -> int:
        """Give back the pages of free frames, partial ones first, until `nbytes` are freed; returns the bytes
        freed."""
        freed = 0
        for frame in sorted(self._partial) + sorted(self._spare, reverse=True):
            if freed >= nbytes:
                break
            freed += self._filled[frame]
            self._drop(frame, 0)
            self._partial.discard(frame)
            self._spare.discard(frame)
        return freed

    def _drop(self, frame: int, keep: int) -> None:
        """Give back `frame`'s pages beyond its first `keep` bytes (a multiple of 4 KiB)."""
        have = self._filled[frame]
        if have > keep:
            self._map.madvise(mmap.MADV_DONTNEED, self._skip + frame * FRAME + keep, have - keep)
            self.populated -= have - keep
            self._filled[frame] = keep
