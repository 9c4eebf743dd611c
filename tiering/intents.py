"""Intents: what a segment's user says about its future (a part of SwapManager, cut out as one concept).

Hints that steer eviction and write-behind (`expect_overwrite`, `expect_fetch`) and `discard`, the word that
a segment's bytes are needed no more; plus `_when_settled`, how a call that changes an unpinned segment waits
for a move of it to end.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

from .errors import IllegalTransitionError, TieringError
from .eviction import Kind
from .segment import Segment


class Intents:
    def expect_overwrite(self, name: str) -> None:
        """Say that the next fetch of `name` will most likely overwrite it (a parameter shard the coming
        optimizer step rewrites), so its bytes are likely read no more: where room is needed, a copy whose
        bytes its home already holds is given up before any other, and prefetch along the trace does not read
        it back. Only a hint: a copy not yet written home is kept and written as usual, so a fetch that reads
        after all (a skipped step, a checkpoint) finds the current bytes. Lasts until the next fetch."""
        with self._lock:
            self._get(name).overwrite_expected = True

    def expect_fetch(self, name: str) -> None:
        """Say that `name` will be fetched again soon by a thread whose fetches are off the trace (a step
        running during the backward), so the trace's far next use does not get it written early: write-behind
        leaves it, and making room evicts it as one needed now (after every copy the trace needs later; a fetch
        that must have room still takes it). Only a hint; lasts until the next fetch."""
        with self._lock:
            self._get(name).fetch_expected = True

    def discard(self, name: str) -> None:
        """Nobody needs the segment's bytes any more (as `release(discard=True)` says for a pinned one): its
        copies above home are dropped unwritten and its next fetch must overwrite. It must be unpinned; a move
        under way is waited for."""
        def drop(seg: Segment) -> None:
            seg.spent = True
            self._unprefetch(seg)
            while seg.state.tier not in (None, seg.home):  # each step drops a copy unwritten
                if self._evict_step(seg, blocking=False).kind is not Kind.DONE:
                    break

        self._when_settled(name, "discard", drop, failed_move_ok=True)

    def _when_settled(self, name: str, action: str, change: Callable[[Segment], None], *,
                      failed_move_ok: bool = False) -> None:
        """Apply `change(seg)` under the lock once `name` is unpinned with no move of it under way, waiting for
        such a move outside the lock (`failed_move_ok`: its failure is not raised, the change not needing the
        bytes it moved)."""
        while True:
            with self._lock:
                seg = self._get(name)
                if seg.pins:
                    raise IllegalTransitionError(name, action, "unpinned", f"pinned {seg.pins} times")
                pending = seg.move if seg.state.moving else None
                if pending is None:
                    change(seg)
                    return
            with contextlib.suppress(TieringError) if failed_move_ok else contextlib.nullcontext():
                pending.wait()
