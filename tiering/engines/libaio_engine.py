"""Linux kernel AIO (io_submit / io_getevents), submitted and reaped by a C thread (tiering/_aio.c).

The C reaper keeps the queue full without the GIL, however busy the training thread keeps it; a Python thread of
our own takes the completions and runs their callbacks (checksums, the swap manager's bookkeeping) off that path.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time

from ..aio_config import AioConfig
from ..errors import EngineUnavailableError, IOFailedError
from ..handle import Handle
from .base import IOEngine, Op, block_result


def load_aio():
    """The compiled queue (tiering._aio), or EngineUnavailableError saying why it is missing."""
    try:
        from .. import _aio
    except ImportError as exc:
        raise EngineUnavailableError(
            f"engine 'libaio' needs the C extension tiering._aio, built at install where a C compiler is present "
            f"(pip install -e . with gcc): {exc}") from exc
    return _aio


class LibaioEngine(IOEngine):
    name = "libaio"

    def __init__(self, config: AioConfig):
        aio = load_aio()
        self._block_size = config.block_size
        try:
            self._queue = aio.Queue(config.queue_depth, single_submit=config.single_submit,
                                    overlap_events=config.overlap_events)
        except OSError as exc:
            raise EngineUnavailableError(
                f"engine 'libaio': io_setup({config.queue_depth}) failed: {exc.strerror} (is fs.aio-max-nr "
                "exhausted? see /proc/sys/fs/aio-nr; lower aio.queue_depth or use engine 'threads')") from exc
        self._tokens = itertools.count()
        self._blocks: dict[int, tuple[Handle, Op, str, int, int]] = {}
        self._lock = threading.Lock()
        self._broken: str | None = None
        self._closed = False
        self._completer = threading.Thread(target=self._complete, name="tiering-libaio-done", daemon=True)
        self._completer.start()

    def blocks(self, nbytes: int) -> int:
        return -(-nbytes // self._block_size)

    def submit(self, op: Op, fd: int, path: str, address: int, nbytes: int, offset: int, handle: Handle) -> None:
        bs, write = self._block_size, op == "write"
        batch = []
        with self._lock:
            broken = self._broken
            if broken is None:
                for start in range(0, nbytes, bs):
                    token, size = next(self._tokens), min(bs, nbytes - start)
                    self._blocks[token] = (handle, op, path, offset + start, size)
                    batch.append((token, write, fd, address + start, size, offset + start))
        if broken is not None:
            for start in range(0, nbytes, bs):
                handle.part_done(IOFailedError(path, op, offset + start, min(bs, nbytes - start), broken, 0))
            return
        try:
            self._queue.submit(batch)
        except (RuntimeError, MemoryError) as exc:  # closed under us (io_getevents failed since the check above), a
            # forked child, or no memory for the queue's lists: nothing of the batch was queued
            with self._lock:
                for token, *_ in batch:
                    del self._blocks[token]
            why = self._broken or str(exc) or "no memory for the AIO queue's lists"
            for _, _, _, _, size, at in batch:
                handle.part_done(IOFailedError(path, op, at, size, why, 0))

    def _complete(self) -> None:
        """The completer thread: each block's result to its handle, until the queue is closed and drained."""
        while completions := self._wait_done():
            with self._lock:
                blocks = [(self._blocks.pop(token), result) for token, result in completions]
            for (handle, op, path, offset, nbytes), result in blocks:
                try:
                    handle.part_done(block_result(op, path, offset, nbytes, result))
                except BaseException:  # noqa: BLE001  (a callback's: the thread must live, or every later handle hangs)
                    logging.getLogger(__name__).exception("completing a block of %s raised", path)
        with self._lock:  # the reaper ended: on close, or on an io_getevents failure (every block owed failed)
            if not self._closed:
                self._broken = "libaio engine broken: io_getevents failed"

    def _wait_done(self) -> list[tuple[int, int]]:
        """The queue's next completions; out of memory, they stay queued in C and are asked for again."""
        while True:
            try:
                return self._queue.wait_done()
            except MemoryError:
                time.sleep(0.01)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._queue.close()
        self._completer.join()
