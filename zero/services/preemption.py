"""Preemption: a scheduler's warning signal (SIGTERM; Slurm's SIGUSR1 with `--signal`) becomes a checkpoint at
the next step boundary and a clean exit, so a long run on a shared machine loses at most one step.

The handler only notes the signal: saving is a collective of every rank and must happen between steps, never
inside the handler (which runs between two bytecodes of whatever the main thread was doing). At each boundary
every rank joins one all-reduce (`save_due`), whether or not it watches for signals, so a signal that reached some
ranks alone still saves on all of them, at the same step, and ranks that watch while others do not fail together
instead of waiting forever in a save the others never join. The exit waits for the next forward, so the training
loop still logs the step it saved.
"""
from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from ..comm import DataParallel

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    def __init__(self, save_dir: str | os.PathLike, signals: tuple[int, ...] = SIGNALS):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("save_on_signal must be called from the main thread (Python delivers signals there)")
        self.save_dir = os.fspath(save_dir)
        self.received: int | None = None
        """The signal noted on this rank, if any."""
        self.saved: str | None = None
        """The checkpoint saved on it: the engine exits at its next forward."""
        self.failed = False
        """The save on it raised: that error, not the signal delivered again at close, says why there is none."""
        self._previous = {sig: signal.signal(sig, self._note) for sig in signals}

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def close(self) -> int | None:
        """Give the signals back to the handlers they had. Returns a signal noted and not acted on (no boundary
        came after it), for the caller to deliver to them once it has cleaned up: it is not lost."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
        return self.received if self.saved is None and not self.failed else None


class UnevenWatchError(RuntimeError):
    """Some ranks watch for preemption signals and others do not: their saves could never meet."""


def save_due(preemption: Preemption | None, dp: DataParallel) -> bool:
    """At a step boundary, on every rank, `preemption` its watch (None where it keeps none, or saved already):
    whether any rank noted a signal, the same answer on every rank. With several ranks one all-reduce of two flags
    per rank, run whether or not this rank watches (a rank that does not cannot know that another does): where
    some ranks watch and others do not, every rank raises UnevenWatchError naming them, at the first boundary."""
    if dp.world_size == 1:
        return preemption is not None and preemption.received is not None
    flags = torch.zeros(2, dp.world_size)
    if preemption is not None:
        flags[0, dp.rank], flags[1, dp.rank] = 1.0, float(preemption.received is not None)
    dp.all_reduce_sum(flags)
    watching = flags[0].nonzero().flatten().tolist()
    if 0 < len(watching) < dp.world_size:
        idle = [r for r in range(dp.world_size) if r not in watching]
        raise UnevenWatchError(f"save_on_signal (or save_on_signal=True) was set up on rank(s) {watching} and not on "
                               f"{idle} of {dp.world_size}: every rank must set it up before the same step boundary "
                               "(saving is a collective of every rank)")
    return bool(flags[1].any())


class SignalSaves:
    """The engine's save_on_signal: its `preemption` and `_preemption_state`, the checkpoint at the boundary."""

    def save_on_signal(self, save_dir: str | os.PathLike, client_state: Callable[[], Any] | None = None,
                       signals: tuple[int, ...] = SIGNALS) -> None:
        """On one of `signals` (SIGTERM, SIGUSR1) to any rank: at the next step boundary every rank saves a
        checkpoint under `save_dir` (with `client_state()`, if given), rank 0 printing where; the next forward
        closes the engine and exits with status 0 (so the loop still logs the step saved). Call it from the main
        thread, on every rank before the same step boundary: set up on some ranks alone, that boundary raises
        UnevenWatchError on every rank (their saves would never meet). load_checkpoint(save_dir) resumes."""
        if self.preemption is not None:
            self.preemption.close()
        self.preemption = Preemption(save_dir, signals)
        self._preemption_state = client_state

    def _save_for_exit(self) -> None:
        received = self.preemption.received
        state = self._preemption_state() if self._preemption_state is not None else None
        try:
            self.preemption.saved = self.save_checkpoint(self.preemption.save_dir, client_state=state)
        except BaseException:
            self.preemption.failed = True
            raise
        if self.dp.rank == 0:
            why = signal.Signals(received).name if received is not None else "a signal to another rank"
            print(f"zero: {why}: saved a checkpoint at step {self.global_steps} to {self.preemption.saved}; "
                  "exiting", flush=True)
