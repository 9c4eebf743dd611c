"""The small interface every NVMe I/O engine implements; NvmeStore adds the checks and the accounting."""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Literal

from ..errors import IOFailedError
from ..handle import Handle

Op = Literal["read", "write"]


class IOEngine(ABC):
    """Moves byte ranges between host memory and an open file descriptor, many requests in flight.

    Callers pass aligned addresses, offsets and lengths (NvmeStore checks them) and keep the memory alive
    until the handle is done.
    """

    name: str

    @abstractmethod
    def submit(self, op: Op, fd: int, path: str, address: int, nbytes: int, offset: int, handle: Handle) -> None:
        """Queue one transfer; call `handle.part_done()` once per block of `blocks(nbytes)`."""

    @abstractmethod
    def blocks(self, nbytes: int) -> int:
        """How many parts a transfer of `nbytes` is cut into."""

    @abstractmethod
    def close(self) -> None:
        """Wait for everything in flight, then free the engine's resources."""


def block_result(op: Op, path: str, offset: int, nbytes: int, result: int) -> IOFailedError | None:
    """The error for a block whose syscall returned `result` (bytes moved, or -errno), or None if it moved all."""
    if result == nbytes:
        return None
    if result < 0:
        return IOFailedError(path, op, offset, nbytes, os.strerror(-result), -result)
    return IOFailedError(path, op, offset, nbytes, f"short {op}: {result} of {nbytes} bytes moved")
