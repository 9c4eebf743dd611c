"""Linux kernel AIO (io_submit / io_getevents) through the PyPI `libaio` package's ctypes bindings.

One submitter path (the caller's thread, refilled from the reaper) and one reaper thread that blocks in
io_getevents while requests are in flight and sleeps on a condition otherwise: no busy-waiting.
"""
from __future__ import annotations

import ctypes
import threading
from collections import deque

from ..aio_config import AioConfig
from ..errors import EngineUnavailableError, IOFailedError
from ..handle import Handle
from .base import IOEngine, Op, block_result


def load_libaio():
    """The ctypes bindings, or EngineUnavailableError saying what is missing."""
    try:
        from libaio import libaio as raw
    except ImportError as exc:
        raise EngineUnavailableError(
            f"engine 'libaio' needs the PyPI package 'libaio' (pip install libaio): {exc}"
        ) from exc
    except OSError as exc:
        raise EngineUnavailableError(
            f"engine 'libaio' needs the system library libaio.so.1 (apt-get install libaio1): {exc}"
        ) from exc
    return raw


class LibaioEngine(IOEngine):
    name = "libaio"

    def __init__(self, config: AioConfig):
        self._raw = raw = load_libaio()
        self._block_size = config.block_size
        self._depth = config.queue_depth
        self._single_submit = config.single_submit
        self._overlap_events = config.overlap_events
        self._ctx = raw.io_context_t()
        try:
            raw.io_setup(self._depth, ctypes.byref(self._ctx))
        except OSError as exc:
            raise EngineUnavailableError(
                f"engine 'libaio': io_setup({self._depth}) failed: {exc.strerror} (is fs.aio-max-nr exhausted? "
                "see /proc/sys/fs/aio-nr; lower aio.queue_depth or use engine 'threads')") from exc
        self._iocbs = (raw.iocb * self._depth)()
        self._iocb_ptrs = (raw.iocb_p * self._depth)(*[ctypes.pointer(c) for c in self._iocbs])
        self._events = (raw.io_event * self._depth)()
        # slot index -> (handle, op, path, offset, nbytes) of the block using that iocb
        self._slots: list[tuple | None] = [None] * self._depth
        self._free = list(range(self._depth - 1, -1, -1))
        self._pending: deque[tuple] = deque()
        self._in_flight = 0
        self._cond = threading.Condition()
        self._closing = False
        self._reaper = threading.Thread(target=self._reap, name="tiering-libaio-reaper", daemon=True)
        self._reaper.start()

    def blocks(self, nbytes: int) -> int:
        return -(-nbytes // self._block_size)

    def submit(self, op: Op, fd: int, path: str, address: int, nbytes: int, offset: int, handle: Handle) -> None:
        bs = self._block_size
        with self._cond:
            if self._closing:
                raise RuntimeError("libaio engine is closed")
            for start in range(0, nbytes, bs):
                self._pending.append((handle, op, fd, path, address + start, min(bs, nbytes - start), offset + start))
            refused = self._pump()
        self._finish(refused)

    def _pump(self) -> list[tuple[Handle, BaseException | None]]:
        """Submit pending blocks into free slots; returns the blocks the kernel refused, to be completed by
        the caller once it has dropped the lock (completion callbacks may take other locks)."""
        refused: list[tuple[Handle, BaseException | None]] = []
        if not self._overlap_events and self._in_flight:
            return refused
        raw = self._raw
        batch: list[int] = []
        while self._free and self._pending:
            handle, op, fd, path, address, nbytes, offset = self._pending.popleft()
            slot = self._free.pop()
            iocb = self._iocbs[slot]
            prep = raw.io_prep_pread if op == "read" else raw.io_prep_pwrite
            prep(iocb, fd, ctypes.c_void_p(address), nbytes, offset)
            iocb.data = ctypes.c_void_p(slot + 1)  # +1: a NULL data pointer reads back as None
            self._slots[slot] = (handle, op, path, offset, nbytes)
            batch.append(slot)
        step = 1 if self._single_submit else len(batch) or 1
        for i in range(0, len(batch), step):
            self._submit_slots(batch[i : i + step], refused)
        self._cond.notify()
        return refused

    @staticmethod
    def _finish(completions: list[tuple[Handle, BaseException | None]]) -> None:
        for handle, error in completions:
            handle.part_done(error)

    def _submit_slots(self, slots: list[int], refused: list) -> None:
        raw = self._raw
        array = (raw.iocb_p * len(slots))(*[self._iocb_ptrs[s] for s in slots])
        done = 0
        while done < len(slots):
            try:
                n = raw.io_submit(self._ctx, len(slots) - done, ctypes.cast(
                    ctypes.byref(array, done * ctypes.sizeof(raw.iocb_p)), raw.iocb_pp))
            except OSError as exc:
                # The kernel refused the request outright (EINVAL, EBADF, ...): fail that block's handle.
                slot = slots[done]
                handle, op, path, offset, nbytes = self._slots[slot]
                self._release(slot)
                refused.append((handle, block_result(op, path, offset, nbytes, -exc.errno)))
                done += 1
                continue
            self._in_flight += n
            done += n

    def _release(self, slot: int) -> None:
        self._slots[slot] = None
        self._free.append(slot)

    def _reap(self) -> None:
        raw = self._raw
        while True:
            with self._cond:
                while not self._in_flight:
                    if self._closing and not self._pending:
                        return
                    self._cond.wait()
            # io_getevents releases the GIL (ctypes) and returns as soon as one request completes.
            try:
                n = raw.io_getevents(self._ctx, 1, self._depth, self._events, None)
            except InterruptedError:
                continue
            except OSError as exc:
                self._fail_all(exc)
                return
            finished = []
            with self._cond:
                for i in range(n):
                    event = self._events[i]
                    slot = event.data - 1
                    handle, op, path, offset, nbytes = self._slots[slot]
                    finished.append((handle, block_result(op, path, offset, nbytes, event.res)))
                    self._release(slot)
                self._in_flight -= n
                finished += self._pump()
                self._cond.notify_all()
            self._finish(finished)

    def _fail_all(self, exc: OSError) -> None:
        """io_getevents itself failed: the engine is broken. Every request owed a completion fails (the
        kernel may still touch their buffers, so callers must not reuse them), and so does every later one."""
        with self._cond:
            self._closing = True
            owed = [slot for slot in self._slots if slot is not None] + [
                (h, op, path, offset, nbytes) for h, op, _, path, _, nbytes, offset in self._pending]
            self._pending.clear()
            self._in_flight = 0
        self._finish([(h, IOFailedError(path, op, offset, nbytes, f"libaio engine broken: io_getevents: {exc}",
                                        exc.errno or 0)) for h, op, path, offset, nbytes in owed])

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._reaper.join()
        if self._ctx:
            self._raw.io_destroy(self._ctx)
            self._ctx = None
