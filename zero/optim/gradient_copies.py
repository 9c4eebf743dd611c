"""Each unit's reduced gradient leaves the device for the host, where the optimizer works: in the dtype it was
reduced in (2 bytes a parameter over the bus in bf16 or fp16; the cast to fp32 happens on the host), asynchronously
on the copy stream, a sub-group's part at a time, into staging buffers of (pinned) host memory, one event per copy.

The host adds a part to its sub-group on a thread of its own (the adder), in the order the copies were queued,
each once its copy's event has passed: the backward's thread only queues, so neither the adds nor their waits
(for a copy, for host room to hold the accumulated gradient) hold back the next unit's backward. A device scratch
is reused only after the copy that read it; a staging buffer only after its copy and the add that read it; the
backward waits for the adds at its end (`drain`). Without CUDA the copy worker runs the copies with the same rules,
so CI checks the ordering a GPU needs (tests/test_gradient_copies.py)."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
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
    added: Future
    """The adder's run of the part's add (its sub-group's accumulation), once the copy has landed."""


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
        self._adder = ThreadPoolExecutor(1, thread_name_prefix="zero-gradient-add")
        self.adding_s = 0.0
        """The adder's seconds in adds since the engine was built, its waits for the copies not counted
        (bench/gpu_check.py reports it: near the backward's length, the adder is what bounds the step)."""

    def scratch(self) -> int:
        """The device scratch the next unit reduces into: every copy that read it has landed."""
        slot = self._next_scratch
        for landing in self._landings:
            if landing.scratch == slot:
                landing.event.synchronize()
        self._next_scratch = (slot + 1) % SLOTS
        return slot

    def send(self, scratch: int, part: torch.Tensor, add: Callable[[torch.Tensor], None]) -> Future:
        """Copy `part` (on the device, in scratch `scratch`) to the host; the adder runs `add(host part)` once it
        has landed. Returns the add's future (done: the part is in its sub-group)."""
        slot = self._next_staging
        while any(landing.staging == slot for landing in self._landings):
            self._land()
        if slot == len(self._buffers):
            self._buffers.append(self.swap.acquire_host(self._nbytes, f"gradient staging {slot}"))
        staged = self._buffers[slot].view(part.dtype, (part.numel(),))
        event = self.swap.device_tier.copy(staged, part)
        added = self._adder.submit(self._add, event, staged, add)
        self._landings.append(Landing(event, slot, scratch, added))
        self._next_staging = (slot + 1) % SLOTS
        return added

    def _add(self, event: CopyEvent, staged: torch.Tensor, add: Callable[[torch.Tensor], None]) -> None:
        event.synchronize()
        start = time.perf_counter()
        try:
            with self.swap.untraced():  # interleaved with the backward's fetches differently every step
                add(staged)
        finally:
            self.adding_s += time.perf_counter() - start

    def drain(self) -> None:
        """Land every copy still in flight (the backward's gradients are all added) and give the staging back."""
        while self._landings:
            self._land()
        self._give_back()

    def _land(self) -> None:
        self._landings.popleft().added.result()

    def close(self) -> None:
        """Give the staging buffers back once no copy or add uses them (a part not yet added is dropped)."""
        while self._landings:
            landing = self._landings.popleft()
            if not landing.added.cancel():
                landing.added.exception()  # wait: an add under way still reads its staging buffer
            landing.event.synchronize()
        self._adder.shutdown()
        self._give_back()

    def _give_back(self) -> None:
        for buffer in self._buffers:
            buffer.release()
        self._buffers = []
        self._next_staging = 0
