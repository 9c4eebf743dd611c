"""NVMe I/O engines and the choice among them (`auto` | `libaio` | `threads`)."""
from __future__ import annotations

from typing import NamedTuple

from ..aio_config import AioConfig
from ..errors import DirectIOUnsupportedError, EngineUnavailableError
from .base import IOEngine
from .libaio_engine import LibaioEngine, load_aio
from .threads_engine import ThreadsEngine

__all__ = ["IOEngine", "LibaioEngine", "ThreadsEngine", "EngineChoice", "choose_engine", "load_aio"]


class EngineChoice(NamedTuple):
    engine: IOEngine
    reason: str


def choose_engine(config: AioConfig, path: str, direct_io: bool, direct_io_detail: str) -> EngineChoice:
    """Build the engine `config.engine` asks for on a file at `path`.

    `auto` takes libaio when its C queue (tiering._aio) is built and the file is open with O_DIRECT (kernel AIO
    without O_DIRECT runs synchronously inside io_submit), else threads; the reason says which case held.
    An explicit `libaio` that cannot run raises instead of falling back.
    """
    if config.engine == "threads":
        mode = "O_DIRECT" if direct_io else f"buffered: {direct_io_detail}"
        return EngineChoice(ThreadsEngine(config), f"threads requested ({mode})")
    try:
        load_aio()
    except EngineUnavailableError as exc:
        if config.engine == "libaio":
            raise
        return EngineChoice(ThreadsEngine(config), f"auto: libaio unavailable ({exc}); using threads")
    if not direct_io:
        if config.engine == "libaio":
            raise DirectIOUnsupportedError(path, "libaio", direct_io_detail)
        return EngineChoice(
            ThreadsEngine(config), f"auto: no O_DIRECT on {path} ({direct_io_detail}); using threads, buffered"
        )
    why = "requested" if config.engine == "libaio" else "auto: its C queue is built and O_DIRECT works"
    try:
        return EngineChoice(LibaioEngine(config), f"libaio ({why})")
    except EngineUnavailableError as exc:
        if config.engine == "libaio":
            raise
        return EngineChoice(ThreadsEngine(config), f"auto: {exc}; using threads")
