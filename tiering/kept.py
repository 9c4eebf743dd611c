"""Kept copies: a segment's bytes preserved while its user writes it speculatively (a part of SwapManager, cut
out as one concept).

`keep(name)` preserves the bytes the segment holds now; `commit(name)` drops them (the writes stand);
`restore(name)` makes them the segment's bytes again (the writes are undone; a segment not written since keeps
its copies). Where the nvme copy is current it is the kept copy and no byte moves: the segment's next write-back
goes to a fresh extent instead of over it (copy on write), and a restore reinstates the old extent with its
checksum, so a damaged file is a ChecksumMismatchError at the read, never wrong bytes; a dirty copy of an
nvme-homed segment is written home first. Elsewhere the bytes are copied into a buffer of the tier holding them
(host or device), within that budget's free room.
"""
from __future__ import annotations

from .errors import IllegalTransitionError
from .handle import Handle
from .residency import Residency
from .segment import Kept, Segment


class Keeping:
    def keep(self, name: str) -> bool:
        """Preserve the segment's current bytes until `commit` or `restore`. It must hold bytes (not spent); a
        move under way is waited for. It may be pinned by readers (a copy reading it): the bytes kept are those
        its copies hold now. False (nothing kept) where no copy fits: no free room in the budget of the tier
        holding the bytes, or no room in the nvme budget for the copy-on-write extent (without a budget: in the
        store's spare bytes, which leave the filesystem a reserve)."""
        while True:
            with self._lock:
                seg = self._get(name)
                if seg.kept is not None:
                    raise IllegalTransitionError(name, "keep", "no kept copy", "a kept copy")
                if seg.spent:
                    raise IllegalTransitionError(name, "keep", "holding bytes", "discarded")
                pending = seg.move if seg.state.moving else None
                if pending is None:
                    kept = self._keep_settled(seg)
                    if isinstance(kept, Handle):
                        pending = kept
                    else:
                        return kept
            pending.wait()

    def _keep_settled(self, seg: Segment) -> bool | Handle:
        """With the lock held and `seg` settled: keep it, or the handle of a move to wait for first."""
        current = seg.home == "nvme" and seg.nvme_current and seg.extent is not None
        if current and self._cow_fits(seg):  # wherever its copies are: none is copied, the device's budget spared
            seg.kept = Kept(seg.extent, seg.checksum, None, None)
            self._cow_pending += seg.nvme_charge
            return True
        if seg.state == Residency.DEVICE:
            free = self.device_tier.free_bytes()
            if free is not None and self.device_tier.charge(seg.nbytes) > free:
                return False
            buffer = self.device_tier.allocate(seg.nbytes, f"{seg.name} (kept)")
            buffer.storage[: seg.nbytes].copy_(seg.storage("device"))
            self._note_peaks()
            seg.kept = Kept(None, None, buffer, "device")
            return True
        if current:
            return False
        if seg.home == "nvme":
            # Written home, then kept there: a kept buffer could not be evicted, and would take room others need.
            return self._clean(seg) if not self._closing else False
        if self.pool.in_use + seg.host_charge <= self._budget("host"):
            buffer = self.pool.acquire(seg.nbytes, f"{seg.name} (kept)")
            buffer.storage[: seg.nbytes].copy_(seg.storage("host"))
            self._note_peaks()
            seg.kept = Kept(None, None, buffer, "host")
            return True
        return False

    def _cow_fits(self, seg: Segment) -> bool:
        """Room for the copy-on-write extent: within the nvme budget, or without one in the store's spare bytes
        (the disk's last bytes are not for an optional copy)."""
        budget = self.store.config.budget
        if budget is not None:
            return self.store.used_bytes + self._cow_pending + seg.nvme_charge <= budget
        return self._cow_pending + seg.nvme_charge <= self.store.spare_bytes()

    def commit(self, name: str) -> None:
        """Drop the kept copy: the bytes written since `keep` stand."""
        with self._lock:
            seg = self._get(name)
            kept, seg.kept = self._take_kept(seg, "commit"), None
            self._free_kept(seg, kept)

    def restore(self, name: str) -> None:
        """Make the kept bytes the segment's again, dropping what was written since `keep` unwritten. The
        segment must be unpinned; a move under way is waited for."""
        def undo(seg: Segment) -> None:
            kept = self._take_kept(seg, "restore")
            seg.kept = None
            if kept.extent is not None and seg.extent == kept.extent and seg.nvme_current and not seg.spent:
                self._cow_pending -= seg.nvme_charge  # never written since: its copies hold the kept bytes
                return
            self._unprefetch(seg)
            self._drop_device(seg)
            seg.spent = False
            if kept.extent is not None:
                if seg.extent == kept.extent:
                    self._cow_pending -= seg.nvme_charge
                elif seg.extent is not None:
                    self.store.free(seg.extent)
                seg.extent, seg.checksum = kept.extent, kept.checksum
                if seg.state != Residency.NVME:
                    seg.to("drop_host" if seg.state == Residency.HOST else "drop_device_to_nvme")
                self._drop_host(seg)
                seg.nvme_current = True
            elif kept.tier == "host":
                if seg.state != Residency.HOST:
                    seg.to("claim_host" if seg.state == Residency.NVME else "drop_device_to_host")
                self._drop_host(seg)
                seg.host = kept.buffer
                seg.host_current = True
                seg.nvme_current = False
            else:  # a device copy: the lower ones hold older bytes, or none
                if seg.state != Residency.DEVICE:
                    seg.to("claim_device" if seg.state == Residency.HOST else "claim_device_from_nvme")
                seg.device = kept.buffer
                seg.host_current = seg.nvme_current = False

        self._when_settled(name, "restore", undo)

    def _take_kept(self, seg: Segment, action: str) -> Kept:
        if seg.kept is None:
            raise IllegalTransitionError(seg.name, action, "a kept copy", "none")
        return seg.kept

    def _free_kept(self, seg: Segment, kept: Kept) -> None:
        """Give back a kept copy's room: its buffer, or its extent unless the segment still reads from it."""
        if kept.tier == "device":
            self.device_tier.free(kept.buffer)
        elif kept.buffer is not None:
            kept.buffer.release()
        elif seg.extent == kept.extent:
            self._cow_pending -= seg.nvme_charge  # never rewritten: the segment's bytes are the kept ones
        else:
            self.store.free(kept.extent)

    def _fresh_extent(self, seg: Segment) -> bool:
        """Whether the segment's next write needs an extent of its own: none yet, or the one it has is its kept
        copy (copy on write)."""
        return seg.extent is None or (seg.kept is not None and seg.kept.extent == seg.extent)
