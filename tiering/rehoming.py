"""Rehoming: segments' home moved between the device and the host (a part of SwapManager, cut out as one concept).

A training engine frees the accelerator between phases (DeepSpeed's `offload_states`, for a generation server on the
same GPU) by lowering its device-homed segments' home to the host, and raises it back before training (its
`reload_states`). Afterwards each segment is exactly as one homed there always is: lowered, on the host with its
device buffer freed; raised, on the device with no host copy. Eviction never moves a device-homed segment, so a
rehome is the only way such bytes leave the device.
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from .errors import IllegalTransitionError, TieringConfigError, TieringError
from .handle import Handle, completed, gather
from .residency import Residency, Tier
from .segment import Segment


class Rehoming:
    def rehome(self, names: Iterable[str], tier: Tier) -> Handle:
        """Give the segments `names` the home `tier` ("device" or "host"; one already homed there is left as it is)
        and move each there on the copy stream; the handle is done once every copy has landed. All or nothing up
        front: moves under way are waited for, every segment must then be unpinned (else IllegalTransitionError),
        and room for all of them is made in `tier` (evicting what may go) before any moves, else
        BudgetExceededError names the bytes the whole rehome needs, and nothing changed."""
        if tier not in ("device", "host"):
            raise TieringConfigError("tier", tier, "'device' or 'host'")
        names = list(dict.fromkeys(names))
        while True:
            with self._lock:
                segs = [seg for seg in map(self._get, names) if seg.home != tier]
                pending = self._rehome_pending(segs)
                if not pending:
                    self._rehome_check(segs, tier)
                    self._rehome_room(segs, tier)  # may let the lock go while write-backs make room
                    if not self._rehome_pending(segs):
                        self._rehome_check(segs, tier)
                        return self._rehome_start(segs, tier)
            for handle in pending:
                with contextlib.suppress(TieringError):  # a failed move rolled back: its error is its waiter's
                    handle.wait()

    def _rehome_pending(self, segs: list[Segment]) -> list[Handle]:
        """What must end before `segs` can move: their moves, and copies reading them (`release_after`)."""
        return [h for seg in segs for h in (seg.move, seg.releasing) if h is not None]

    def _rehome_check(self, segs: list[Segment], tier: Tier) -> None:
        source = "host" if tier == "device" else "device"
        for seg in segs:
            if seg.home != source:
                raise IllegalTransitionError(seg.name, f"rehome to {tier}", f"homed on {source}",
                                             f"homed on {seg.home}")
            if seg.pins:
                raise IllegalTransitionError(seg.name, f"rehome to {tier}", "unpinned",
                                             f"pinned {seg.pins} times in {seg.pinned_tier}")

    def _rehome_room(self, segs: list[Segment], tier: Tier) -> None:
        """Make room in `tier` for every copy the rehome adds there, as one request (so its error names the total)."""
        if tier == "host":
            need = sum(seg.host_charge for seg in segs if seg.host is None)
        else:
            need = sum(self.device_tier.charge(seg.nbytes) for seg in segs if seg.state != Residency.DEVICE)
        if need:
            stand_in = Segment(f"{len(segs)} segments rehomed to {tier}", torch.uint8, (need,), tier,
                               Residency.DEVICE if tier == "device" else Residency.HOST)
            self._fit(tier, stand_in, blocking=True, wait=True, keep=tuple(segs))

    def _rehome_start(self, segs: list[Segment], tier: Tier) -> Handle:
        """With the lock held, the room made and `segs` settled and unpinned: rehome each and start its copy."""
        handles = []
        for seg in segs:
            self._unprefetch(seg)
            seg.home = tier
            if tier == "host":
                if seg.host is None:
                    seg.host = self.pool.acquire(seg.nbytes, seg.name)
                if seg.spent or seg.host_current:  # nothing to copy: the device copy just goes
                    seg.to("drop_device_to_host")
                    self._drop_device(seg)
                else:
                    handles.append(self._to_host(seg))
            elif seg.state == Residency.DEVICE:  # a copy brought up meanwhile: the host copy goes
                self._drop_host(seg)
            else:
                seg.device = self.device_tier.allocate(seg.nbytes, seg.name)
                if seg.spent:
                    seg.to("claim_device")
                    self._drop_host(seg)
                else:
                    handle = self._to_device(seg)
                    handle.add_done_callback(lambda h, s=seg: self._raised(s, h))
                    handles.append(handle)
            self._note_peaks()
        return gather(handles, f"rehome to {tier}") if handles else completed(f"rehome to {tier}")

    def _raised(self, seg: Segment, handle: Handle) -> None:
        """A copy up to a newly device-homed segment ended: its host copy goes, or (the copy failed) its home is
        the host again, where its bytes still are."""
        with self._lock:
            if handle.error is None:
                self._drop_host(seg)
            else:
                seg.home = "host"
