"""Gradients: each unit's gradient reduced across ranks and accumulated in fp32 into its sub-groups, and the
global gradient norm that clipping and fp16 overflow checks read.

A unit's gradients are flattened into one buffer (the unit's layout), divided as DeepSpeed's gradient
averaging asks, reduced (all-reduce, or reduce-scatter when gradients are partitioned: stage 2 on), and this
rank's range is cast to fp32 once and added to the sub-groups' accumulated gradient (AdamDriver.accumulate).
Where they go to the host (and, with several ranks, are reduce-scattered), a sub-group's part at a time is
flattened, reduced and sent, so the device holds scratch of a sub-group's size rather than of the largest unit's.
Where the optimizer works on the host, the range goes there first, asynchronously (gradient_copies.py), and is
added there by a thread of its own; `drain` waits for the last adds at the end of the backward. A unit whose
gradient is final steps early (speculative_step.py) once all its adds are done.
Norms are taken per parameter piece, keyed by the parameter's place in the model, so they sum in torch's
clip_grad_norm_ order; on the accumulation boundary they are taken while the gradient is still in memory.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..comm import DataParallel
from ..services.counters import StepCounters
from ..params.unit import Unit
from .driver import AdamDriver, SubGroup
from .gradient_copies import GradientCopies
from .speculative_step import SpeculativeStep

REDUCTION_SCRATCH = "reduction scratch"
"""The device budget's part the reduction's buffers take: a unit's flattened gradients and its reduced shard, one
of each per device scratch (gradient_copies.SLOTS of them where the gradients go to the host, each then a
sub-group's part: its pieces from every rank's range, and its reduced piece)."""
COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class Gradients:
    def __init__(self, *, driver: AdamDriver, dp: DataParallel, counters: StepCounters, sharded: bool,
                 reduce_scatter: bool, param_order: dict[int, int], largest_unit: int, prescale: bool,
                 predivide_factor: float, communication_data_type: str | None,
                 reserve_device: Callable[[int, str, str], None], unreserve_device: Callable[[int, str], None],
                 speculation: SpeculativeStep | None = None,
                 copies: GradientCopies | None = None, scratch_bytes: int = 0):
        """`sharded`: each rank keeps optimizer state for its shard only (stage 1 on); `reduce_scatter`: the
        reduction leaves each rank its shard only (stage 2 on); `param_order`: id(param) -> its place in
        the model; `largest_unit`: the largest unit's padded element count (the scratch buffers' size);
        `speculation`: where a unit whose gradient is complete goes to be stepped during the backward;
        `copies`: the way to the host, where the optimizer works there; `reserve_device(nbytes, what, part)`:
        counts the scratch buffers made on the device against the device budget (SwapManager.reserve_device),
        `unreserve_device(nbytes, part)` gives the count back when they go (`free_scratch`); `scratch_bytes`: what
        those buffers take of the device budget when all are made (budgets.device_minimum's REDUCTION_SCRATCH)."""
        self.driver = driver
        self.dp = dp
        self.counters = counters
        self.sharded = sharded
        self.reduce_scatter = reduce_scatter
        self.param_order = param_order
        self.largest_unit = largest_unit
        # DeepSpeed's gradient averaging: divide by world_size before the reduction (prescale_gradients), or
        # by gradient_predivide_factor before it and by world_size / factor after it.
        self.predivide = dp.world_size if prescale else predivide_factor
        self.comm_dtype = COMM_DTYPES.get(communication_data_type)
        self.speculation = speculation
        self.copies = copies
        self.reserve_device, self.unreserve_device = reserve_device, unreserve_device
        self._scratches: dict[str, torch.Tensor] = {}
        self._counted: dict[str, int] = {}  # role: the bytes of its scratch counted against the device budget
        self.scratch_bytes = scratch_bytes
        self.divisor = 1
        """A direct backward's accumulation steps (services/direct_backward.py): its gradients are divided as they
        are flattened, where engine.backward divides the loss."""

    def reduce(self, unit: Unit) -> bool:
        """Flatten the unit's gradients (freeing them), reduce them over ranks, add this rank's range in fp32
        to the accumulated gradient of its sub-groups. True when that completes its gradient for the step
        (the accumulation boundary: the optimizer step comes next)."""
        flat, full = unit.flat, unit.full
        dtype = self.comm_dtype or full.dtype
        world = self.dp.world_size
        last = self.counters.at_boundary()  # this step's gradient is complete after these adds
        if self.speculation is not None:  # a round that stepped the unit early would miss these adds (a unit
            self.speculation.touch(unit.sub_groups)  # reduced twice meets its first round here): abandoned
        early = last and self.speculation is not None and self.speculation.running
        if self.copies is not None and (world == 1 or self.reduce_scatter):
            # The parts go to the host a sub-group at a time: each is flattened (from every rank's range, to be
            # reduce-scattered) and reduced as its copy comes, into scratch of a sub-group's size, not the whole
            # unit into buffers of the largest unit's size (a tied embedding's: the device would hold two).
            added = []
            for sg in unit.sub_groups:
                slot = self.copies.scratch()
                add = self._adder(unit, sg, last, early)
                added.append(self.copies.send(slot, self._reduce_part(unit, sg, slot, dtype), add))
            flat.drop_grads()
            if early:
                self.speculation.submit(unit.sub_groups, after=added)
            return last
        slot = self.copies.scratch() if self.copies is not None else 0  # a scratch no copy still reads
        grads = flat.flatten_grads(self._scratch(f"grads{slot}", flat.padded_numel, dtype, full.device))
        flat.drop_grads()
        if self.divisor != 1:
            grads.div_(self.divisor)
        if world > 1 and self.predivide != 1.0:
            grads.div_(self.predivide)
        if self.reduce_scatter and world > 1:  # (one rank: its shard is the whole, reduced already)
            shard = self._scratch(f"shard{slot}", flat.shard_numel, grads.dtype, grads.device,
                                  largest=self.largest_unit // world)
            self.dp.reduce_scatter_sum(grads, shard)
        else:
            self.dp.all_reduce_sum(grads)
            shard = grads.narrow(0, *flat.rank_range(self.sharded))
        if world > 1 and self.predivide != world:
            shard.div_(world / self.predivide)  # the mean over ranks
        added = []
        for sg in unit.sub_groups:
            part = shard.narrow(0, sg.offset, sg.numel)
            add = self._adder(unit, sg, last, early)
            if self.copies is None:
                add(part)
            else:
                added.append(self.copies.send(slot, part, add))
        if early:
            self.speculation.submit(unit.sub_groups, after=added)
        return last

    def _reduce_part(self, unit: Unit, sg: SubGroup, slot: int, dtype: torch.dtype) -> torch.Tensor:
        """Sub-group `sg`'s part of the unit's gradient, reduced over ranks (the mean, as DeepSpeed averages), in
        scratch `slot`: every rank's range holds its sub-groups at the same offsets, so the part's pieces of
        all ranks are flattened side by side and reduce-scattered."""
        flat, world, n = unit.flat, self.dp.world_size, sg.numel
        grads = self._scratch(f"grads{slot}", world * n, dtype, unit.full.device, largest=world * self.copies.numel)
        for rank in range(world):
            flat.flatten_grads(grads[rank * n:(rank + 1) * n], rank * flat.shard_numel + sg.offset)
        if self.divisor != 1:
            grads.div_(self.divisor)
        if world == 1:
            return grads
        if self.predivide != 1.0:
            grads.div_(self.predivide)
        part = self._scratch(f"shard{slot}", n, dtype, grads.device, largest=self.copies.numel)
        self.dp.reduce_scatter_sum(grads, part)
        if self.predivide != world:
            part.div_(world / self.predivide)  # the mean over ranks
        return part

    def _adder(self, unit: Unit, sg: SubGroup, last: bool, early: bool) -> Callable[[torch.Tensor], None]:
        """What adds the sub-group's reduced part, where it lands."""
        return lambda part: self._add(unit, sg, part, last, early)

    def drain(self) -> None:
        """At the end of the backward: every unit's gradient added (those still on their way to the host)."""
        if self.copies is not None:
            self.copies.drain()

    def close(self) -> None:
        if self.copies is not None:
            self.copies.close()

    def _add(self, unit: Unit, sg: SubGroup, part: torch.Tensor, last: bool, early: bool) -> None:
        """Add the sub-group's part of the reduced gradient to its accumulated gradient, in fp32 (cast once, into
        reused memory); on the boundary (`last`) its norms are taken meanwhile."""
        if part.dtype != torch.float32:
            part = self._scratch("fp32", part.numel(), torch.float32, part.device,
                                 on_device=self.copies is None).copy_(part)
        self.driver.accumulate(sg, part, self.pieces(unit, sg) if last else None, fetch_soon=early)

    def norm(self, units: list[Unit]) -> torch.Tensor:
        """The global 2-norm of the accumulated (still loss-scaled) gradient, fp32, computed as torch's
        clipping does: the norm of the per-parameter norms (per parameter piece on this rank's range)."""
        pieces = self.driver.grad_norms(lambda sg: self.pieces(units[sg.unit], sg))
        norms = [norm for _, norm in sorted(pieces, key=lambda kn: kn[0])]
        local = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), dtype=torch.float32)
        if self.dp.world_size == 1:
            return local
        square = local.double().square().reshape(1)
        self.dp.all_reduce_sum(square)
        if not self.sharded:
            square /= self.dp.world_size  # every rank holds every gradient: counted world_size times
        return square.sqrt().float().reshape(())

    def pieces(self, unit: Unit, sg: SubGroup) -> list[tuple[int, int, int]]:
        """(start, length, key) within `sg` of each parameter's part in it: the pieces whose norms torch takes,
        keyed by the parameter's place in the model so they are summed in torch's order."""
        lo = unit.flat.rank_range(self.sharded)[0] + sg.offset
        hi = lo + sg.numel
        out = []
        for slot in unit.flat.slots:
            start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < end:
                out.append((start - lo, end - start, self.param_order[id(slot.param)]))
        return out

    def _scratch(self, role: str, numel: int, dtype: torch.dtype, device: torch.device, *,
                 largest: int | None = None, on_device: bool = True) -> torch.Tensor:
        """A reused buffer of `numel` elements for `role` (gradient reduction runs every micro-batch: fresh
        memory each time would be page faults on every step), made once at the size of the largest request,
        `largest` (default: the largest unit); `on_device`: in the device tier (with CUDA on the GPU; without,
        the CPU stands in for it), so the device budget counts it while it lives."""
        buffer = self._scratches.get(role)
        if buffer is None:
            size = max(numel, self.largest_unit if largest is None else largest)
            if on_device:
                self.reserve_device(size * dtype.itemsize, f"gradient reduction {role}", REDUCTION_SCRATCH)
                self._counted[role] = size * dtype.itemsize
            buffer = self._scratches[role] = torch.empty(size, dtype=dtype, device=device)
        return buffer[:numel]

    def free_scratch(self) -> None:
        """Give back the reduction's reused buffers, between steps; the next backward makes them again (what
        DeepSpeed's offload_states frees as its contiguous gradient buffer)."""
        self._scratches.clear()
        for nbytes in self._counted.values():
            self.unreserve_device(nbytes, REDUCTION_SCRATCH)
        self._counted.clear()
