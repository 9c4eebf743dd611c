"""How fast this machine's nvme_path moves bytes, measured through tiering's own NvmeStore (the engine `auto`
picks there, its 8 MiB requests and queue depth), and the figures saved where the planner reads them.

Three sequential passes over one store file, each repeated REPEATS times (medians reported): write a region,
read it back, then read it while writing a second region (mixed: what a training step does when prefetch reads overlap evictions). Each pass keeps
`WINDOW` transfers of `CHUNK` bytes in flight per direction, enough to keep the engine's queue full. The
written bytes are random (a virtual disk may compress or deduplicate a repeated pattern) and held in RAM
once; reads land in a small ring of buffers. Closing the store removes its file, also on error.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path

import torch

from tiering import ALIGNMENT, NvmeStore, NvmeStoreConfig, aligned_empty
from tiering.errors import fmt_bytes

from .checks import meminfo

MiB = 1 << 20
DEFAULT_FIGURES = Path.home() / ".cache" / "zero_tiering" / "machine.json"
CHUNK = 16 * MiB
"""Bytes per store.read/write call: two of the engine's 8 MiB requests."""
WINDOW = 4
"""Calls in flight per direction: 64 MiB, the default engine's queue (8 requests of 8 MiB) and as much waiting."""
MIN_BYTES = MiB
REPEATS = 3
"""Passes of each kind; the figures are their medians (one pass on a shared disk can be off by 3x)."""


@dataclass(frozen=True)
class DiskFigures:
    nvme_path: str
    """The directory measured, absolute."""
    read_gbps: float
    write_gbps: float
    mixed_gbps: float
    """Bytes read plus bytes written, over the wall time of the pass that did both at once."""
    engine: str
    """The store's engine_reason: which engine `auto` picked there and why (O_DIRECT or buffered)."""
    measured_at: str
    """ISO-8601, UTC."""
    bytes: int
    """Bytes moved per direction in each pass."""


def check_size(nbytes: int) -> None:
    """Raise ValueError unless `nbytes` can be measured: whole 4 KiB blocks (O_DIRECT), at least 1 MiB."""
    if nbytes < MIN_BYTES or nbytes % ALIGNMENT:
        raise ValueError(f"a measurement needs at least {MIN_BYTES} bytes in whole {ALIGNMENT}-byte blocks, "
                         f"got {nbytes}")


def measure(path: str, nbytes: int) -> DiskFigures:
    """Write, read and mixed GB/s (1e9 bytes/s) of `nbytes` per direction in the directory `path`.

    Needs `nbytes` of RAM (the data written) plus the read ring, and 2 * `nbytes` of disk. Raises ValueError
    for a size that cannot be measured or does not fit the RAM available, tiering's typed errors (a path
    that is missing or not writable, a full disk, a failed I/O) otherwise."""
    check_size(nbytes)
    ram, available = nbytes + WINDOW * CHUNK, meminfo()["MemAvailable"]
    if ram > available:
        raise ValueError(f"measuring {fmt_bytes(nbytes)} needs {fmt_bytes(ram)} of RAM, "
                         f"{fmt_bytes(available)} available (MemAvailable)")
    directory = os.path.abspath(path)
    with NvmeStore(NvmeStoreConfig(nvme_path=directory, grow_step=2 * nbytes)) as store:
        sizes = [min(CHUNK, nbytes - at) for at in range(0, nbytes, CHUNK)]
        first, second = ([store.allocate(n, "bandwidth") for n in sizes] for _ in range(2))
        source = aligned_empty(nbytes)
        source.view(torch.int64).random_()
        chunks = [source[at:at + n] for at, n in zip(range(0, nbytes, CHUNK), sizes)]
        ring = [aligned_empty(CHUNK) for _ in range(WINDOW)]
        writes = [(store.write, extent, chunk) for extent, chunk in zip(first, chunks)]
        reads = [(store.read, extent, ring[i % WINDOW]) for i, extent in enumerate(first)]
        second_writes = [(store.write, extent, chunk) for extent, chunk in zip(second, chunks)]
        mixed = [job for pair in zip(reads, second_writes) for job in pair]
        passes: dict[str, list[float]] = {"write": [], "read": [], "mixed": []}
        for _ in range(REPEATS):
            passes["write"].append(_timed(writes, WINDOW))
            passes["read"].append(_timed(reads, WINDOW))
            source.view(torch.int64).random_()  # new bytes for the second region: nothing a disk could deduplicate
            passes["mixed"].append(_timed(mixed, 2 * WINDOW))
        write_s, read_s, mixed_s = (statistics.median(passes[kind]) for kind in ("write", "read", "mixed"))
        engine = store.engine_reason
    return DiskFigures(nvme_path=directory, read_gbps=nbytes / read_s / 1e9, write_gbps=nbytes / write_s / 1e9,
                       mixed_gbps=2 * nbytes / mixed_s / 1e9, engine=engine,
                       measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), bytes=nbytes)


def _timed(jobs: list, window: int) -> float:
    """Wall seconds to run `jobs` ((store.read or store.write, extent, buffer), submitted in order) with at
    most `window` in flight, the oldest waited first. A ring buffer is reused by a read only after the read
    `window` jobs earlier, which used it, was waited; the handles keep their buffers alive until done."""
    began = time.perf_counter()
    in_flight: deque = deque()
    for move, extent, buffer in jobs:
        if len(in_flight) == window:
            in_flight.popleft().wait()
        in_flight.append(move(extent, buffer))
    for handle in in_flight:
        handle.wait()
    return time.perf_counter() - began


def save_figures(figures: DiskFigures, file: str | os.PathLike) -> None:
    """Write `figures` as JSON to `file` atomically (a temporary file beside it, then os.replace), creating
    its directories: a reader sees the old figures or the new ones, never half of either."""
    file = Path(file)
    file.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(figures), f, indent=2)
            f.write("\n")
        os.replace(temp, file)
    except BaseException:
        os.unlink(temp)
        raise


def load_figures(file: str | os.PathLike | None = None) -> DiskFigures | None:
    """The figures saved in `file` (default DEFAULT_FIGURES), None when there is no such file.

    Raises ValueError naming the file and the key for a file that is not JSON, lacks a key, has one we do
    not know, or a value of the wrong type (or not positive, for the figures)."""
    file = Path(DEFAULT_FIGURES if file is None else file)
    try:
        text = file.read_bytes()
    except FileNotFoundError:
        return None
    where = f"disk figures {str(file)!r}"
    try:
        data = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not text
        raise ValueError(f"{where} are not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
    names = [f.name for f in fields(DiskFigures)]
    unknown = sorted(data.keys() - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(names)})")
    for key in names:
        if key not in data:
            raise ValueError(f"{where}: missing key {key!r}")
        value = data[key]
        if key.endswith("_gbps") or key == "bytes":
            kind = int if key == "bytes" else (int, float)
            if isinstance(value, bool) or not isinstance(value, kind) or not (0 < value < math.inf):
                raise ValueError(f"{where}: {key} = {value!r}, expected a positive number")
        elif not isinstance(value, str):
            raise ValueError(f"{where}: {key} = {value!r}, expected a string")
    try:
        datetime.fromisoformat(data["measured_at"])
    except ValueError as exc:
        raise ValueError(f"{where}: measured_at = {data['measured_at']!r}, expected an ISO-8601 time") from exc
    return DiskFigures(**{key: float(data[key]) if key.endswith("_gbps") else data[key] for key in names})
