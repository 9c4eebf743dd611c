"""Trace: the order in which segments are used in one step, recorded in the first step and replayed after.

It answers two questions for the swap manager: what will be needed next (prefetch) and which resident
segment is needed latest (eviction, Belady's rule). A step that departs from the recorded order is noticed
at the first mismatch; from there the manager stops trusting the trace and records the step afresh.
"""
from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator

from .residency import Tier


class Trace:
    def __init__(self) -> None:
        self.uses: list[tuple[str, Tier]] = []  # the reference step: (segment, tier) per fetch
        self.overwrites: frozenset[int] = frozenset()  # positions in `uses` whose fetch read no bytes
        self._recording_overwrites: set[int] = set()
        self._positions: dict[str, list[int]] = {}
        self._bytes_before: list[int] = [0]  # bytes fetched in the reference step before each use
        self._recording: list[tuple[str, Tier]] = []
        self._recording_bytes: list[int] = []
        self.cursor = 0  # index into `uses` of the next expected fetch
        self.on_track = False
        self.departures = 0

    @property
    def ready(self) -> bool:
        return bool(self.uses) and self.on_track

    def record(self, name: str, tier: Tier, nbytes: int, overwrite: bool = False) -> None:
        """Note one fetch by a user (`overwrite`: it needs room, not bytes); follow the reference trace while
        the step matches it."""
        if overwrite:
            self._recording_overwrites.add(len(self._recording))
        self._recording.append((name, tier))
        self._recording_bytes.append(nbytes)
        if not self.on_track:
            return
        if self.cursor < len(self.uses) and self.uses[self.cursor] == (name, tier):
            self.cursor += 1
        else:
            self.on_track = False
            self.departures += 1

    def end_step(self) -> None:
        """Adopt this step's order as the reference when it differs (or there was none); start the next."""
        if self._recording != self.uses or self._recording_overwrites != self.overwrites:
            self.uses = self._recording
            self.overwrites = frozenset(self._recording_overwrites)
            self._positions = {}
            for i, (name, _) in enumerate(self.uses):
                self._positions.setdefault(name, []).append(i)
            self._bytes_before = list(itertools.accumulate(self._recording_bytes, initial=0))
        self._recording = []
        self._recording_bytes = []
        self._recording_overwrites = set()
        self.cursor = 0
        self.on_track = bool(self.uses)

    def upcoming(self) -> Iterator[tuple[str, Tier]]:
        """The uses ahead that need bytes brought, in order, while on track: the rest of this step, then the
        next step's first ones (a training loop starts the next step right after this one ends). Lazily: the
        prefetch walking it stops after a few, and it runs at every fetch and every write that lands."""
        if not self.ready:
            return
        uses, overwrites = self.uses, self.overwrites
        for i in itertools.chain(range(self.cursor, len(uses)), range(self.cursor)):
            if i not in overwrites:
                yield uses[i]

    def _next_position(self, name: str) -> float:
        """Index of the next use of `name` counted from the start of this step (past the end: the next
        step's); inf if the trace never uses it or is not being followed."""
        positions = self._positions.get(name)
        if not positions or not self.ready:
            return math.inf
        i = bisect.bisect_left(positions, self.cursor)
        return positions[i] if i < len(positions) else positions[0] + len(self.uses)

    def next_use(self, name: str) -> float:
        """How many uses from now until `name` is needed again (wrapping into the next step); inf if never."""
        return self._next_position(name) - self.cursor

    def next_use_bytes(self, name: str) -> float:
        """Bytes fetched from now until `name` is needed again; inf if never."""
        position = self._next_position(name)
        if position == math.inf:
            return math.inf
        total = self._bytes_before[-1]
        laps, index = divmod(int(position), len(self.uses))
        return laps * total + self._bytes_before[index] - self._bytes_before[self.cursor]
