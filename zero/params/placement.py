"""Placement: how parameters are held, the one place the engine and checkpoints learn it from.

Two implementations: ResidentPlacement (stages 0-2: every unit's full buffer stays on the device) and
PartitionedPlacement (stage 3: this rank's shard rests in a tier; the full buffer exists only while the unit
runs). The engine and the checkpoint code call these methods and never branch on the stage.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch

from ..optim.driver import SubGroup
from .unit import Unit


class Placement(ABC):
    units: list[Unit]
    sharded: bool
    """Each rank keeps optimizer state (and, partitioned, parameters) for its shard of each unit only."""

    def rank_range(self, unit: Unit) -> tuple[int, int]:
        """(start, numel) of the unit's flat buffer this rank keeps in the compute dtype and steps."""
        return unit.flat.rank_range(self.sharded)

    @abstractmethod
    def shard(self, unit: Unit, *, write: bool = False, overwrite: bool = False) -> contextlib.AbstractContextManager[torch.Tensor]:
        """This rank's compute-dtype range of the unit (`rank_range`) for the length of a block. `write`: the
        block writes it (it becomes the unit's truth); `overwrite`: it writes every element before reading one
        (nothing needs reading first)."""

    @abstractmethod
    def gather(self, unit: Unit) -> None:
        """Make the unit's full buffer hold its values until the matching `release`."""

    @abstractmethod
    def release(self, unit: Unit) -> None:
        """Drop one `gather`."""

    def frees_on_release(self, unit: Unit) -> bool:
        """Whether the `release` matching the latest `gather` gives the unit's full buffer's bytes back (views of
        it then read nothing, or another unit's bytes): a caller that may keep them gets a copy instead."""
        return False

    @abstractmethod
    def finish_backward(self) -> None:
        """After loss.backward(): every unit's gradient reduced into its sub-groups."""

    @abstractmethod
    def shards_changed(self, *, stepped: bool = False) -> None:
        """The ranks' ranges were rewritten (an optimizer step, a checkpoint load): full buffers that exist
        take the new values. `stepped`: by an optimizer step, which never writes a frozen shard."""

    def step_started(self) -> None:
        """An optimizer step runs on another thread (overlap_step): gathered units refill at their next gather."""

    @contextlib.contextmanager
    def step_output(self, sg: SubGroup) -> Iterator[torch.Tensor]:
        """Where sub-group `sg`'s updated weights go: its slice of this rank's range of the unit's parameters,
        as the placement holds them, written."""
        # A unit's sub-groups step in one pass, in order, together covering its range: the first one's fetch
        # needs no bytes, as the pass rewrites them all.
        with self.shard(self.units[sg.unit], write=True, overwrite=sg.offset == 0) as shard:
            yield shard.narrow(0, sg.offset, sg.numel)

    def step_segment(self, sg: SubGroup) -> str | None:
        """The swap manager's segment that `step_output(sg)` writes, if any (what a speculative step keeps)."""
        return None

    def adopt_full(self, unit: Unit) -> None:
        """The values in the unit's (gathered) full buffer become the truth of this rank's range."""

    def close(self) -> None:
        """Undo what the placement changed on the model (hooks)."""

