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
    def __init__(self) -> None:
        self._ready: list[threading.Event] = []
        self._left: list[int] = []
        self._failed = False  # set before the waiting are let go, so a failed step is never taken as done
        self._future: Future | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="zero-step")

    def start(self, step: Callable[[Callable[[int], None]], None], sub_groups_per_unit: Sequence[int]) -> None:
        """Run `step(done)` on the step thread; it calls `done(u)` after each sub-group of unit u, and unit u
        is updated once `sub_groups_per_unit[u]` of them are done."""
        self.wait_all()
        self._left = list(sub_groups_per_unit)
        self._failed = False
        self._ready = [threading.Event() for _ in self._left]
        for event, count in zip(self._ready, self._left):
            if not count:  # a unit with nothing to update is never waited for
                event.set()
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
