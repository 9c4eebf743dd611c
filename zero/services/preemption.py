"""Preemption: a scheduler's warning signal (SIGTERM; Slurm's SIGUSR1 with `--signal`) becomes a checkpoint at
the next step boundary and a clean exit, so a long run on a shared machine loses at most one step.

The handler only notes the signal: saving is a collective of every rank and must happen between steps, never
inside the handler (which runs between two bytecodes of whatever the main thread was doing). At each boundary
the ranks agree with one all-reduce (the sum of the noted flags), so a signal that reached some ranks alone still
saves on all of them, at the same step. The exit waits for the next forward, so the training loop still logs
the step it saved.
"""
from __future__ import annotations

import os
import signal
import threading
from types import FrameType

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
        self._previous = {sig: signal.signal(sig, self._note) for sig in signals}

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def requested(self, dp: DataParallel) -> bool:
        """Whether any rank noted a signal: the same answer on every rank (one all-reduce of one element)."""
        if dp.world_size == 1:
            return self.received is not None
        flag = torch.tensor([float(self.received is not None)])
        return dp.all_reduce_sum(flag).item() > 0

    def close(self) -> int | None:
        """Give the signals back to the handlers they had. Returns a signal noted and not acted on (no boundary
        came after it), for the caller to deliver to them once it has cleaned up: it is not lost."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
        return self.received if self.saved is None else None
