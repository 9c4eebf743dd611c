"""OverlappedStep: ZeRO-3's optimizer step on a background thread while the next forward pass runs.

The step updates sub-groups unit by unit, in the order the forward gathers units (the root unit first, then
the blocks). The next forward waits, at each unit's gather, for that unit's update only: every value it
reads is the one the step in place would have left, so results are bit for bit those of the synchronous
step, while the step's nvme reads and writes (and its arithmetic) run behind the forward of the units before.
Whatever reads every parameter or the optimizer state (backward, the next step, checkpoints, gathering all
parameters) waits for the whole step; an error raised by the step is raised there, or at the next gather.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor


class OverlappedStep:
    def __init__(self, sub_groups_per_unit: Sequence[int]):
        """`sub_groups_per_unit[u]`: how many sub-groups a step reports done for unit u before the unit is
        updated."""
        self._counts = list(sub_groups_per_unit)
        self._ready = [threading.Event() for _ in self._counts]
        for event in self._ready:
            event.set()
        self._left = list(self._counts)
        self._failed = False  # set before the waiting are let go, so a failed step is never taken as done
        self._future: Future | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="zero-step")

    def start(self, step: Callable[[Callable[[int], None]], None]) -> None:
        """Run `step(done)` on the step thread; it calls `done(u)` after each sub-group of unit u."""
        self.wait_all()
        self._left = list(self._counts)
        self._failed = False
        for event, count in zip(self._ready, self._counts):
            if count:  # a unit with nothing to update is never waited for
                event.clear()
        self._future = self._pool.submit(self._run, step)

    def wait_unit(self, unit: int) -> None:
        """Return once unit `unit` is updated (at once if no step is running); a failed step raises here."""
        future = self._future
        if future is None:
            return
        self._ready[unit].wait()
        if self._failed:
            self.wait_all()

    def wait_all(self) -> None:
        """Return once the step running (if any) has finished; raise its error if it failed."""
        future, self._future = self._future, None
        if future is not None:
            future.result()

    def close(self) -> None:
        try:
            self.wait_all()
        finally:
            self._pool.shutdown()

    def _run(self, step: Callable[[Callable[[int], None]], None]) -> None:
        try:
            step(self._done)
        except BaseException:
            self._failed = True
            raise
        finally:
            for event in self._ready:  # after a failure too: nobody may wait for an update that never comes
                event.set()

    def _done(self, unit: int) -> None:
        self._left[unit] -= 1
        if self._left[unit] == 0:
            self._ready[unit].set()
