"""Each unit's reduced gradient leaves the device for the host, where the optimizer works: in the dtype it was
reduced in (2 bytes a parameter over the bus in bf16 or fp16; the cast to fp32 happens on the host), asynchronously
on the copy stream, a sub-group's part at a time, into staging buffers of (pinned) host memory, one event per copy.

The host adds a part to its sub-group only when its staging buffer comes round again, or when the device scratch
the copy read is needed by the unit after next, or at the end of the backward: it never waits for the copy it has
just queued, so copies overlap the backward. A staging buffer, and the device scratch its copy reads, are reused
only after that copy's event and the add that read it. Without CUDA the copy worker runs the copies with the same
rules, so CI checks the ordering a GPU needs (tests/test_gradient_copies.py)."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tiering import SwapManager
from tiering.copy_stream import CopyEvent
from tiering.host_pool import HostBuffer

SLOTS = 2
"""Staging buffers, and device scratches: one landing while the next is copied."""


@dataclass
class Landing:
    event: CopyEvent
    staging: int
    scratch: int
    staged: torch.Tensor
    add: Callable[[torch.Tensor], None]
    """What to do with the part once it is on the host (its sub-group's accumulation)."""


class GradientCopies:
    def __init__(self, swap: SwapManager, numel: int, dtype: torch.dtype):
        """Staging for parts of up to `numel` elements of `dtype` (the largest sub-group): taken from the host
        budget by the backward's first copy (evicting cached state, as bringing a segment to the host would) and
        given back when the backward's last part has landed, so the optimizer step has that room."""
        self.swap = swap
        self.numel = max(numel, 1)
        """The largest part a copy carries (what a device scratch for one part holds)."""
        self._nbytes = self.numel * dtype.itemsize
        self._buffers: list[HostBuffer] = []
        self._landings: deque[Landing] = deque()  # in the order the copies were queued
        self._next_scratch = self._next_staging = 0

    def scratch(self) -> int:
        """The device scratch the next unit reduces into: every copy that read it has landed."""
        slot = self._next_scratch
        while any(landing.scratch == slot for landing in self._landings):
            self._land()
        self._next_scratch = (slot + 1) % SLOTS
        return slot

    def send(self, scratch: int, part: torch.Tensor, add: Callable[[torch.Tensor], None]) -> None:
        """Copy `part` (on the device, in scratch `scratch`) to the host; `add(host part)` runs once it has
        landed, when its staging buffer is needed again or at `drain`."""
        slot = self._next_staging
        while any(landing.staging == slot for landing in self._landings):
            self._land()
        if slot == len(self._buffers):
            self._buffers.append(self.swap.acquire_host(self._nbytes, f"gradient staging {slot}"))
        staged = self._buffers[slot].view(part.dtype, (part.numel(),))
        self._landings.append(Landing(self.swap.device_tier.copy(staged, part), slot, scratch, staged, add))
        self._next_staging = (slot + 1) % SLOTS

    def drain(self) -> None:
        """Land every copy still in flight (the backward's gradients are all added) and give the staging back."""
        while self._landings:
            self._land()
        self._give_back()

    def _land(self) -> None:
        landing = self._landings.popleft()
        landing.event.synchronize()
        landing.add(landing.staged)

    def close(self) -> None:
        """Give the staging buffers back once no copy uses them (a part not yet added is dropped)."""
        while self._landings:
            self._landings.popleft().event.synchronize()
        self._give_back()

    def _give_back(self) -> None:
        for buffer in self._buffers:
            buffer.release()
        self._buffers = []
        self._next_staging = 0
