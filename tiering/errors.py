"""Typed errors for the tiering layer.

Every error names the thing at fault and carries the numbers (budgets, offsets, sizes) as attributes and in
its message, so a user can act on it without reading our code.
"""
from __future__ import annotations

import errno


def fmt_bytes(n: int) -> str:
    """Human-readable size with a binary unit (errors and reports speak in these)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


class TieringError(Exception):
    """Base class of every error raised by tiering/."""


class TieringConfigError(TieringError, ValueError):
    """A config field has a bad value; the message names the field and the value."""

    def __init__(self, field: str, value: object, expected: str):
        self.field, self.value = field, value
        super().__init__(f"{field} = {value!r}: {expected}")


class BudgetExceededError(TieringError, MemoryError):
    """A tier's hard budget cannot hold a request, even after evicting what could be evicted."""

    def __init__(self, tier: str, budget: int, in_use: int, requested: int, what: str = "", path: str = "",
                 parts: dict[str, int] | None = None):
        self.tier, self.budget, self.in_use, self.requested, self.what = tier, budget, in_use, requested, what
        self.path = path  # the store file, for tier 'nvme'
        self.parts = parts or {}  # what holds the budget, by part (the device tier's)
        target = f" for {what!r}" if what else ""
        where = f" in {path!r}" if path else ""
        held = ", ".join(f"{part} {fmt_bytes(n)}" for part, n in self.parts.items() if n)
        super().__init__(
            f"{tier} budget {fmt_bytes(budget)} exhausted{where}: {fmt_bytes(in_use)} in use"
            f"{f' ({held})' if held else ''}, {fmt_bytes(requested)} requested{target}"
        )


class PinnedMemoryError(TieringError, MemoryError):
    """The CUDA runtime refused to page-lock a host buffer."""

    def __init__(self, size: int, cuda_error: int):
        self.size, self.cuda_error = size, cuda_error
        super().__init__(f"cannot pin {fmt_bytes(size)} of host memory: cudaHostRegister returned error "
                         f"{cuda_error}; lower the host budget, or set pin_memory: false in offload_param and "
                         "offload_optimizer (copies then block the thread that issues them)")


class DeviceOutOfMemoryError(TieringError, MemoryError):
    """CUDA ran out of memory for an allocation within the device budget: memory outside the budget (activations,
    other processes) left too little. Names the budget, what was live (by part) and what was asked."""

    def __init__(self, what: str, requested: int, budget: int | None, in_use: int, reserved: int, allocated: int,
                 parts: dict[str, int] | None = None):
        self.what, self.requested, self.budget, self.in_use = what, requested, budget, in_use
        self.reserved, self.allocated, self.parts = reserved, allocated, parts or {}
        limit = "no device budget" if budget is None else f"device budget {fmt_bytes(budget)}"
        held = ", ".join(f"{part} {fmt_bytes(n)}" for part, n in self.parts.items() if n)
        super().__init__(
            f"CUDA out of memory allocating {fmt_bytes(requested)} for {what!r}: {limit}, {fmt_bytes(in_use)} of it "
            f"in use by the tiers{f' ({held})' if held else ''}; torch holds {fmt_bytes(allocated)} allocated, "
            f"{fmt_bytes(reserved)} reserved (the rest is activations and other processes): lower device_budget or "
            "the batch size")


class NvmePathError(TieringError, OSError):
    """The nvme_path is missing, not a directory, or not writable."""

    def __init__(self, path: str, reason: str):
        self.path = path
        super().__init__(f"nvme_path {path!r}: {reason}")


class DirectIOUnsupportedError(TieringError, OSError):
    """The filesystem under a path refuses O_DIRECT, and the chosen engine needs it."""

    def __init__(self, path: str, engine: str, detail: str):
        self.path, self.engine = path, engine
        super().__init__(
            f"{path!r} does not support O_DIRECT ({detail}); engine {engine!r} needs it: "
            f"put nvme_path on a disk filesystem (ext4, xfs) or use engine 'threads'"
        )


class EngineUnavailableError(TieringError, RuntimeError):
    """An explicitly requested I/O engine cannot run on this machine."""


class StoreRangeError(TieringError, IndexError):
    """A read or write reaches outside an extent or the store."""

    def __init__(self, path: str, offset: int, nbytes: int, limit: int, what: str):
        self.path, self.offset, self.nbytes, self.limit = path, offset, nbytes, limit
        super().__init__(
            f"{what} in {path!r}: offset {offset} + {nbytes} bytes exceeds {limit} bytes"
        )


class StoreFullError(TieringError, OSError):
    """The filesystem under the store could not give the bytes (ENOSPC, EFBIG, a quota)."""

    def __init__(self, path: str, requested: int, size: int, err: OSError):
        self.path, self.requested, self.size = path, requested, size
        super().__init__(
            err.errno,
            f"cannot grow {path!r} from {fmt_bytes(size)} by {fmt_bytes(requested)}: "
            f"{err.strerror or err}",
        )


class NvmeSpaceError(TieringError, OSError):
    """The state homed on nvme cannot fit, found before any of it is written: too little free space in a
    directory of nvme_path, or an nvme budget below it."""

    def __init__(self, where: str, needed: int, limit: int, limit_is: str):
        self.where, self.needed, self.limit = where, needed, limit
        super().__init__(errno.ENOSPC, f"{where}: the state homed on nvme needs {fmt_bytes(needed)}, more than "
                                       f"{limit_is.format(fmt_bytes(limit))}")


class IOFailedError(TieringError, OSError):
    """A read or write did not complete in full; nothing about it is reported done."""

    def __init__(self, path: str, op: str, offset: int, nbytes: int, detail: str, errno_: int = 0):
        self.path, self.op, self.offset, self.nbytes = path, op, offset, nbytes
        super().__init__(errno_, f"{op} of {nbytes} bytes at offset {offset} in {path!r} failed: {detail}")


class AlignmentError(TieringError, ValueError):
    """A buffer handed to O_DIRECT I/O is not aligned or too small."""


class ChecksumMismatchError(TieringError):
    """Bytes read back from nvme do not match the checksum recorded when they were written."""

    def __init__(self, what: str, path: str, offset: int, expected: int, actual: int):
        self.what, self.path, self.offset = what, path, offset
        super().__init__(
            f"checksum mismatch for {what!r} read from {path!r} at offset {offset}: "
            f"expected {expected:#010x}, got {actual:#010x}"
        )


class IllegalTransitionError(TieringError, RuntimeError):
    """A residency change that the transition table does not allow."""

    def __init__(self, what: str, action: str, expected: object, actual: object):
        self.what, self.action, self.expected, self.actual = what, action, expected, actual
        super().__init__(f"{action} of {what!r}: expected state {expected}, actual {actual}")
