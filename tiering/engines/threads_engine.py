"""The portable engine: os.preadv / os.pwritev from a small thread pool (both release the GIL)."""
from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

from ..aio_config import AioConfig
from ..handle import Handle
from .base import IOEngine, Op, block_result


class ThreadsEngine(IOEngine):
    name = "threads"

    def __init__(self, config: AioConfig):
        self._block_size = config.block_size
        self._pool = ThreadPoolExecutor(config.intra_op_parallelism, thread_name_prefix="tiering-io")

    def blocks(self, nbytes: int) -> int:
        return -(-nbytes // self._block_size)

    def submit(self, op: Op, fd: int, path: str, address: int, nbytes: int, offset: int, handle: Handle) -> None:
        bs = self._block_size
        for start in range(0, nbytes, bs):
            self._pool.submit(self._run, op, fd, path, address + start, min(bs, nbytes - start), offset + start, handle)

    @staticmethod
    def _run(op: Op, fd: int, path: str, address: int, nbytes: int, offset: int, handle: Handle) -> None:
        view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
        moved = 0
        try:
            while moved < nbytes:
                chunk = view[moved:]
                n = os.preadv(fd, [chunk], offset + moved) if op == "read" else os.pwritev(fd, [chunk], offset + moved)
                if n == 0:
                    break
                moved += n
            error = block_result(op, path, offset, nbytes, moved)
        except OSError as exc:
            error = block_result(op, path, offset, nbytes, -(exc.errno or 5))
        except BaseException as exc:  # never leave the handle pending
            error = exc
        handle.part_done(error)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
