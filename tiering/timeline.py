"""Stats and timeline: what the swap manager moved, how long callers stalled, and a Chrome trace of it all.

The timeline records every move (on the lane of the path it used) and every compute span the caller
marks; `write_chrome_trace` writes JSON that Perfetto and chrome://tracing open.
"""
from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

LANES = {"compute": 0, "nvme->host": 1, "host->nvme": 2, "host->device": 3, "device->host": 4, "stall": 5}


@dataclass
class SwapStats:
    bytes_moved: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Bytes per tier pair, e.g. 'nvme->host'."""
    segment_bytes: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    """Bytes per tier pair and segment name: what one segment cost (a read-only segment's writes stay 0)."""
    stall_seconds: float = 0.0
    """Time callers spent blocked waiting for bytes: in `acquire`, and in a gather waiting for its unit's copy."""
    hits: int = 0
    """Fetches of a segment already in the tier, or that a prefetch had brought (or was bringing) there."""
    misses: int = 0
    """Fetches that had to start the move themselves (trace or not)."""
    prefetches: int = 0
    peak_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def as_dict(self) -> dict:
        return {
            "bytes_moved": dict(self.bytes_moved),
            "stall_seconds": self.stall_seconds,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hit_rate,
            "prefetches": self.prefetches,
            "peak_bytes": dict(self.peak_bytes),
        }


class Timeline:
    """Spans (name, lane, start, end) in perf_counter seconds, kept only while `enabled`."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.spans: list[tuple[str, str, float, float, dict]] = []
        self._lock = threading.Lock()
        self._origin = time.perf_counter()

    def add(self, name: str, lane: str, start: float, end: float, **args: object) -> None:
        if self.enabled:
            with self._lock:
                self.spans.append((name, lane, start, end, args))

    @contextmanager
    def span(self, name: str, lane: str = "compute", **args: object):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, lane, start, time.perf_counter(), **args)

    def busy_seconds(self, *lanes: str, since: float = 0.0) -> float:
        """Length of the union of the spans on any of `lanes` that start at or after `since`: a read and a write
        in flight together are busy once, not twice."""
        with self._lock:
            intervals = sorted((s, e) for _, l, s, e, _ in self.spans if l in lanes and s >= since)
        total, end = 0.0, -1.0
        for s, e in intervals:
            if s > end:
                total += e - s
                end = e
            elif e > end:
                total += e - end
                end = e
        return total

    def write_chrome_trace(self, path: str) -> None:
        with self._lock:
            events = [
                {"name": name, "cat": lane, "ph": "X", "pid": 0, "tid": LANES.get(lane, 9),
                 "ts": (s - self._origin) * 1e6, "dur": (e - s) * 1e6, "args": args}
                for name, lane, s, e, args in self.spans
            ]
        meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": lane}}
                for lane, tid in LANES.items()]
        with open(path, "w") as f:
            json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, f)
