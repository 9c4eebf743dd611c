"""Handles: what every asynchronous operation returns. `wait()` blocks until done and raises its error;
`done()` polls. The blocking form of any operation is "submit, then wait on the same handle"."""
from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable


class Handle:
    """Completion of an operation made of `parts` pieces (e.g. the blocks of one transfer).

    The handle is done only when every part has finished, also after a failure: a buffer is never handed
    back while some of its blocks are still in flight. The first error is kept and raised by `wait()`.
    Whatever is passed as `keepalive` (the I/O buffer) is referenced until the handle is done.
    """

    __slots__ = ("_pending", "_event", "_error", "_lock", "_callbacks", "_keepalive", "label")

    def __init__(self, parts: int = 1, *, label: str = "", keepalive: object = None):
        self._pending = parts
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Handle], None]] = []
        self._keepalive = keepalive
        self.label = label
        if parts == 0:
            self._event.set()

    def part_done(self, error: BaseException | None = None) -> None:
        """Called by whoever runs a part (an engine's reaper thread, a copy stream)."""
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._pending -= 1
            if self._pending:
                return
            callbacks, self._callbacks = self._callbacks, []
            self._keepalive = None
        try:
            for callback in callbacks:
                try:
                    callback(self)
                except Exception:  # a faulty callback must not leave the handle (and its waiters) hanging
                    logging.getLogger(__name__).exception("done callback of %r raised", self)
        finally:
            self._event.set()

    def add_done_callback(self, callback: Callable[[Handle], None]) -> None:
        """Run `callback(handle)` once done (now, if already done), on the thread that completes it."""
        with self._lock:
            if self._pending:
                self._callbacks.append(callback)
                return
        callback(self)

    def done(self) -> bool:
        return self._event.is_set()

    @property
    def error(self) -> BaseException | None:
        # Once every part is in (callbacks run before the event is set, and gather reads it there).
        return None if self._pending > 0 else self._error

    def wait(self, timeout: float | None = None) -> None:
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self.label or 'operation'} not done after {timeout} s")
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        state = "failed" if self.error else ("done" if self.done() else "pending")
        return f"Handle({self.label!r}, {state})"


def completed(label: str = "") -> Handle:
    """A handle that is already done: what an operation with nothing to move returns."""
    return Handle(0, label=label)


def gather(handles: Iterable[Handle], label: str = "") -> Handle:
    """One handle that is done when all of `handles` are; it raises the first error among them."""
    handles = list(handles)
    group = Handle(len(handles), label=label)
    for handle in handles:
        handle.add_done_callback(lambda h: group.part_done(h.error))
    return group


def settled(handle: Handle, label: str = "") -> Handle:
    """Done when `handle` is, and never failed: for a waiter that needs only the operation over (the room it
    frees), where its error is its owner's to raise."""
    out = Handle(label=label)
    handle.add_done_callback(lambda h: out.part_done())
    return out
