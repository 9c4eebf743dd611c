"""Unit: the engine's one record per unit (its flattened parameters, its full buffer, its shard, its
sub-groups), UnitState, the unit's life within a step, as tiering's Residency is a segment's, and Fill, the copy
of its shard into its full buffer, kept with the buffer it guards.

One enum and one table of legal transitions; every change goes through `Unit.to(action)`, which raises
IllegalTransitionError naming the unit, the action, the states it allows and the state it found. Units whose
parameters stay resident (stages 0-2) are GATHERED for good; partitioned units (stage 3) move through all
of it. How many holders a gathered unit has is counted (`refs`), so nested and repeated use keep its bytes.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from enum import Enum

import torch
from torch import nn

from tiering import Handle, HostBuffer, IllegalTransitionError
from tiering.copy_stream import CopyEvent

from ..optim.driver import SubGroup
from .ds_param import ZeroParamStatus, set_status
from .flat_unit import FlatUnit

GATHERED = "gathered units"
GRADIENTS = "unit gradients"
"""The device budget's parts partitioned units count (with the segments and the reduction's scratch): the full
buffers of gathered and prefetched units, and autograd's gradients of a unit in its backward until reduced (a
tied head's among them: tied_head.py)."""


class UnitState(Enum):
    RELEASED = "released: the full buffer holds no bytes"
    PREFETCHED = "prefetched: the full buffer has bytes and its fill is under way or done; nobody holds it yet"
    GATHERED = "gathered: the full buffer holds the current values"
    BACKWARD = "gathered, its backward begun: gradients awaited"
    STALE = "gathered across an optimizer step that rewrote its shard: refilled at its next gather"


S = UnitState
TRANSITIONS: dict[str, tuple[frozenset[UnitState], UnitState]] = {
    "prefetch": (frozenset({S.RELEASED}), S.PREFETCHED),
    "gather": (frozenset({S.PREFETCHED}), S.GATHERED),
    "drop": (frozenset({S.PREFETCHED}), S.RELEASED),
    "refill": (frozenset({S.STALE}), S.GATHERED),
    "arm": (frozenset({S.GATHERED}), S.BACKWARD),
    "grads_ready": (frozenset({S.BACKWARD}), S.GATHERED),
    "release": (frozenset({S.GATHERED, S.STALE}), S.RELEASED),
    "stepped": (frozenset({S.GATHERED}), S.STALE),
}
DS_STATUS = {S.RELEASED: ZeroParamStatus.NOT_AVAILABLE, S.PREFETCHED: ZeroParamStatus.INFLIGHT,
             S.GATHERED: ZeroParamStatus.AVAILABLE, S.BACKWARD: ZeroParamStatus.AVAILABLE,
             S.STALE: ZeroParamStatus.AVAILABLE}
"""What DeepSpeed's `ds_status` says of a partitioned parameter in each state."""
del S


@dataclass(eq=False)
class Unit:
    index: int
    """Position in the engine's unit list, and in a checkpoint's unit layout."""
    flat: FlatUnit
    """The unit's parameters, their offsets in the flat buffer, its padding and this rank's shard."""
    module: nn.Module
    """The module whose forward the unit follows (the model itself for the root unit)."""
    full: torch.Tensor
    """The full flat buffer in the compute dtype, the parameters views into it; a partitioned unit's storage
    has size 0 while it is released."""
    sub_groups: list[SubGroup]
    """This rank's fp32 optimizer state of the unit, in order of offset."""
    segment: str | None = None
    """Swap-manager segment holding this rank's shard in the compute dtype (partitioned units)."""
    int8: bool = False
    """A frozen unit whose shard rests as block-wise int8 (int8_weights.py), decoded where it is gathered."""
    staging: torch.Tensor | None = None
    """An int8 unit's stored bytes on the device while it holds bytes, before they are decoded into `full`."""
    persistent: bool = False
    """Small enough to stay gathered once gathered (stage3_param_persistence_threshold)."""
    parked: bool = False
    """Held (gathered, counted in `refs`) but its bytes given back until its next use (root_uses.py)."""
    state: UnitState = UnitState.GATHERED
    refs: int = 0
    """Holders of the gathered bytes: forward, backward, a nested call, gathered_parameters."""
    backward_refs: int = 0
    """Of `refs`, those its backward drops once every gradient is in."""
    forwards: int = 0
    """Forward calls of its module whose pre-hook gathered it and whose (always called) forward hook has not run."""
    grads_pending: int = 0
    """Parameters whose gradient backward has not produced yet (in state BACKWARD)."""
    grads_reserved: bool = False
    """The device budget counts autograd's gradients of its parameters (from its backward's start to its reduce)."""
    fill: Fill | None = None
    """The last copy of the shard into the full buffer (partitioned units)."""
    versions: list[int] = field(default_factory=list)
    """Frozen units: their parameters' version counters when the forward gathered them."""
    lent: HostBuffer | None = None
    """Without CUDA, the device tier's pool buffer whose bytes the full buffer holds while it has any."""
    hooks: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.flat.name

    @property
    def nbytes(self) -> int:
        """Bytes of the full buffer when gathered."""
        return self.flat.padded_numel * self.full.element_size()

    @property
    def frozen(self) -> bool:
        """No gradient, no optimizer state: its shard is read, never written (FlatUnit.frozen)."""
        return self.flat.frozen

    @property
    def block(self) -> nn.Module:
        """The module of the unit's block: its own, or, for a frozen part (wrap_policy.frozen_parts), the module it
        was cut from."""
        return self.flat.within or self.module

    @property
    def gathered(self) -> bool:
        return self.state not in (UnitState.RELEASED, UnitState.PREFETCHED)

    def to(self, action: str) -> None:
        """Apply `action` (a key of TRANSITIONS); IllegalTransitionError if the table has no such edge."""
        sources, target = TRANSITIONS[action]
        if self.state not in sources:
            raise IllegalTransitionError(f"unit {self.name or 'root'}", action,
                                         " or ".join(s.name for s in sources), self.state.name)
        self.state = target
        if self.segment is not None:  # partitioned: DeepSpeed's readers see the state in ds_status
            set_status((slot.param for slot in self.flat.slots), DS_STATUS[target])


class Fill:
    """The copy of a unit's shard into its full buffer: the shard fetched (pinned), the copy queued on the copy
    stream, the shard released once the copy has landed. Compute reads the full buffer only after `wait()`;
    the shard is written, and (without CUDA) the full buffer's bytes go back to the pool, only after `settle()`
    (with CUDA the caching allocator holds a freed full buffer until the copy stream recorded on it is past).

    `queued` is done once the copy is queued (at once when the shard was in its tier; after the read when it
    came from nvme), `copied` is then the copy's event, and `done` is done once the copy has ended and the
    shard is released. Each carries the error of the step that failed."""

    __slots__ = ("queued", "copied", "done")

    def __init__(self, name: str):
        self.queued = Handle(label=f"fill {name or 'root'}: copy queued")
        self.copied: CopyEvent | None = None
        self.done = Handle(label=f"fill {name or 'root'}")

    def wait(self) -> None:
        """Make the caller's compute wait for the bytes: the host for the copy to be queued (the shard's read,
        if it was under way), then the compute stream for the copy's event (without CUDA, the caller's thread
        for the copy)."""
        self.queued.wait()
        self.copied.wait()

    def settle(self) -> None:
        """Host-wait until the copy has ended and the shard is released, however it ended (a failure is reported
        by `wait`, to whoever needed the bytes)."""
        with contextlib.suppress(Exception):
            self.done.wait()
