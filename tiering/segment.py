"""Segment: the swap manager's one record per flat run of bytes (where its copies are, who uses it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .aligned import align_up
from .device_tier import DeviceBuffer
from .extents import Extent
from .handle import Handle
from .host_pool import HostBuffer
from .residency import Residency, Tier


class Kept(NamedTuple):
    """What `SwapManager.keep` preserved (tiering/kept.py): the nvme extent (and the checksum of its bytes), or a
    buffer in `tier` holding them."""

    extent: Extent | None
    checksum: int | None
    buffer: HostBuffer | DeviceBuffer | None
    tier: Tier | None


@dataclass(eq=False)
class Segment:
    name: str
    dtype: torch.dtype
    shape: torch.Size
    home: Tier
    """The lowest tier the segment rests in; eviction moves it back here, never below."""
    state: Residency
    nbytes: int = field(init=False)

    device: DeviceBuffer | HostBuffer | None = None
    """Device-tier buffer (a HostBuffer from the device pool without CUDA), when a device copy exists."""
    host: HostBuffer | None = None
    """Host buffer, when a host copy exists."""
    extent: Extent | None = None
    """Range of the store file, once the segment was first written to nvme."""
    host_current: bool = False
    """The host copy holds the current bytes (dropping the device copy loses nothing)."""
    nvme_current: bool = False
    """The nvme copy holds the current bytes (dropping the host copy loses nothing)."""
    checksum: int | None = None
    """Checksum of the bytes last written to nvme, verified on read."""
    spent: bool = False
    """Its bytes are not needed (released with `discard`, or fetched to be overwritten): no copy of it is
    read, copied or written back, and its next fetch must overwrite it."""

    pins: int = 0
    """Users holding a view; a pinned segment is never moved."""
    pinned_tier: Tier | None = None
    move: Handle | None = None
    """The move in flight, if any: waiting on it is how a caller waits for the segment."""
    last_use: int = 0
    """Tick of the last fetch: the LRU order before a trace exists."""
    prefetched: bool = False
    """Brought in by prefetch and not yet fetched by a user (a fetch then counts as a hit)."""
    frozen: bool = False
    """Registered as only read by steps (frozen weights, inference's): what the read-ahead stages (read_ahead.py)."""
    staged: bool = False
    """Of those, read to host by the read-ahead beyond the prefetch window (`ReadAhead._stage`): counted apart from
    `prefetch_bytes`, and still to be brought the rest of the way when the window reaches it."""
    overwrite_expected: bool = False
    """The user expects its next fetch to overwrite it (`SwapManager.expect_overwrite`), until that fetch."""
    writes: int = 0
    """Dirty releases so far: a write-behind that began before the last one marks nothing current."""
    fetch_expected: bool = False
    """The user expects to fetch it again soon, off the trace (`SwapManager.expect_fetch`), until that fetch."""
    releasing: Handle | None = None
    """A copy reading its pinned bytes, whose end releases one pin (`SwapManager.release_after`)."""
    kept: Kept | None = None
    """The bytes preserved by `SwapManager.keep` until `commit` or `restore`."""

    def __post_init__(self) -> None:
        self.shape = torch.Size(self.shape)
        self.nbytes = self.shape.numel() * self.dtype.itemsize

    def to(self, action: str) -> None:
        """Apply a residency transition, raising IllegalTransitionError with expected vs actual state."""
        self.state = self.state.after(action, self.name)

    def unpin(self) -> None:
        self.pins -= 1
        if not self.pins:
            self.pinned_tier = None

    @property
    def lands_home(self) -> bool:
        """Whether the move under way ends in the home tier."""
        return self.state == Residency.WRITING or (self.state == Residency.TO_HOST and self.home == "host")

    def evictable_from(self, tier: Tier) -> bool:
        """Whether the copy in `tier` may be freed now. Never a pinned copy or one at home; a host copy under a
        device copy is a cache, droppable even while the device copy is pinned."""
        if self.state.moving:
            return False
        if tier == "device":
            return self.state == Residency.DEVICE and self.home != "device" and not self.pins
        return self.host is not None and (
            self.state == Residency.DEVICE or (self.state == Residency.HOST and self.home == "nvme" and not self.pins))

    @property
    def host_charge(self) -> int:
        """What a host copy takes from the host budget: whole 4 KiB pages."""
        return align_up(max(self.nbytes, 1))

    @property
    def nvme_charge(self) -> int:
        """What an extent of it takes from the store's budget and the disk: whole 4 KiB blocks, at least one."""
        return align_up(max(self.nbytes, 1))

    def capacity(self, tier: Tier) -> int:
        """Bytes the copy in `tier` holds (a reused buffer may be larger than the segment)."""
        return (self.device if tier == "device" else self.host).capacity

    def storage(self, tier: Tier) -> torch.Tensor:
        """The uint8 bytes of the copy in `tier` (device or host)."""
        buffer = self.device if tier == "device" else self.host
        return buffer.storage[: self.nbytes]

    def view(self, tier: Tier) -> torch.Tensor:
        return self.storage(tier).view(self.dtype).view(self.shape)
