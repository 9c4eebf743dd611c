"""FullValues: the engine's answers about whole parameters, whatever the stage holds of them: full values for the
length of a block (GatheredParameters, modified or not) and one parameter's training state gathered from every
rank (zero.utils' safe_get_* and safe_set_*). A mixin of ZeroEngine, which owns the units, placement, driver and
ranks it reads."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..optim.driver import STATE_PARTS, SubGroup
from .flat_unit import ParamSlot
from .unit import Unit

LENT = "GatheredParameters' copies"
"""The device tier's part the private copies of full buffers a GatheredParameters block lends count as."""


class FullValues:
    @contextlib.contextmanager
    def gathered_parameters(self, params: list[nn.Parameter] | None = None, modify: bool = False,
                            modifier_rank: int | None = None):
        """Inside the block the given parameters (default: all) hold their full values, as DeepSpeed's
        GatheredParameters gives them; every rank calls it. With `modify=True` the values they hold on exit
        become the model's: the fp32 masters of the elements that changed (an unchanged one keeps its fp32 bits,
        not the compute dtype's) and, for stage 3, the parameter shards are rewritten; every rank must make the
        same change. With `modifier_rank` (DeepSpeed's), the values that rank holds on exit are first sent to
        every rank, then become the model's. Moments are kept. A block that raises (or one without `modify` or
        `modifier_rank`) leaves the masters as they were; what it wrote in place into a full buffer that stays
        (stages 0-2, a persistent unit) is there until the next step rewrites it from them.

        A unit this block alone gathers lends its parameters a private copy of its full buffer, not views of it:
        the release gives the full buffer's bytes back (to nothing, or to the device tier's pool), and a tensor the
        caller kept (`p.data`, `p.data.cpu()` on a CPU, a view) must stay valid after the block, as DeepSpeed's
        does. What the parameters hold on exit (written in place or assigned to `p.data`) is what is adopted, in
        a block nested in another too; on exit they are views again of what they were views of before it. The copy
        counts against the device budget (as `LENT`) while the block holds it, beside the gathered unit: a block
        the budget cannot hold raises BudgetExceededError. A copy the caller keeps past the block (`p.data` taken
        inside) is no longer counted: its bytes are the caller's."""
        self._finish_step()
        modifying = modify or modifier_rank is not None
        wanted = None if params is None else {id(p) for p in params}
        chosen = [unit for unit in self.units
                  if wanted is None or any(id(slot.param) in wanted for slot in unit.flat.slots)]
        held: list[Unit] = []
        lent: list[Unit] = []
        entry: dict[int, torch.Tensor] = {}
        try:
            for unit in chosen:
                self.placement.gather(unit)
                held.append(unit)
                if modifying:  # in host memory: the device budget has no room for it
                    entry[unit.index] = unit.full.to("cpu", copy=True)
                if self.placement.frees_on_release(unit):
                    self.swap.reserve_device(unit.nbytes, f"{unit.name} (a GatheredParameters copy)", LENT)
                    lent.append(unit)
                    self._lent[unit.index] = unit.full.clone()
                    unit.flat.bind(self._lent[unit.index])
            yield
            for unit in chosen if modifying else ():
                unit.flat.flatten(unit.full)  # the parameters may be views of a lent copy, or assigned
                if modifier_rank is not None:
                    self.dp.broadcast(unit.full, modifier_rank)
                self._adopt_full_values(unit, wanted, entry[unit.index])
                if unit not in lent and unit.index in self._lent:
                    self._lent[unit.index].copy_(unit.full)  # an enclosing block's copy: its caller sees them
        finally:
            for unit in held:
                copy = self._lent.pop(unit.index, None) if unit in lent else self._lent.get(unit.index)
                unit.flat.bind(unit.full if copy is None or unit in lent else copy)
            for unit in lent:
                self.swap.unreserve_device(unit.nbytes, LENT)
            for unit in held:  # a lent unit's caller keeps the private copy; the release unbinds
                self.placement.release(unit)

    def _adopt_full_values(self, unit: Unit, wanted: set[int] | None, before: torch.Tensor) -> None:
        """Make the unit's full buffer the truth for the parameters in `wanted` (None: all): copy the elements of
        their part of this rank's range that differ from `before` (the full buffer when the block began) into the
        masters (each sub-group fetched once), and the range into the shard (the others' values are its own)."""
        ranges = ([(0, unit.flat.padded_numel)] if wanted is None else
                  [(slot.offset, slot.numel) for slot in unit.flat.slots if id(slot.param) in wanted])
        runs: dict[int, tuple[SubGroup, list[tuple[int, int, int]]]] = {}
        for start, length in ranges:
            for sg, at, offset, numel in self._pieces(unit, start, length):
                runs.setdefault(id(sg), (sg, []))[1].append((at, offset, numel))
        for sg, pieces in runs.values():
            with self.driver.held(sg, "master", dirty=True) as master:
                for at, offset, numel in pieces:
                    new = unit.full.narrow(0, offset, numel).to(master.device)
                    changed = new != before.narrow(0, offset, numel).to(master.device)
                    master.narrow(0, at, numel)[changed] = new.to(master.dtype)[changed]
        self.placement.adopt_full(unit)

    def _pieces(self, unit: Unit, offset: int, numel: int) -> Iterator[tuple[SubGroup, int, int, int]]:
        """Where the flat range [offset, offset + numel) of `unit` meets this rank's sub-groups: (sub-group,
        offset in it, offset in the flat buffer, length)."""
        start = self.placement.rank_range(unit)[0]
        for sg in unit.sub_groups:
            lo, hi = max(offset, start + sg.offset), min(offset + numel, start + sg.offset + sg.numel)
            if lo < hi:
                yield sg, lo - start - sg.offset, lo, hi - lo

    # -- one parameter's training state, whole (zero.utils' safe_get_* and safe_set_*) ---------------------------

    def _slot_of(self, param: torch.Tensor) -> tuple[Unit, ParamSlot] | None:
        """Where the engine trains `param` (frozen units hold no training state)."""
        for unit in self.units:
            for slot in () if unit.frozen else unit.flat.slots:
                if slot.param is param:
                    return unit, slot
        return None

    def full_state(self, param: torch.Tensor, part: str) -> torch.Tensor | None:
        """`param`'s whole fp32 `part` ("master", "exp_avg", "exp_avg_sq", or "grad": the gradient accumulated
        since the last step, unscaled) in its shape, gathered from every rank; every rank calls it. None for a
        parameter the engine does not train, or for "grad" when no gradient waits for a step."""
        found = self._slot_of(param)
        if found is None:
            return None
        _check_part(part)
        self._finish_step()
        unit, slot = found
        out = torch.zeros(slot.numel + 1, dtype=torch.float32)  # the last element counts pieces holding gradients
        for sg, at, offset, numel in self._pieces(unit, slot.offset, slot.numel):
            if part == "grad" and sg.grad_fresh:
                continue  # a spent gradient: zeros
            with self.driver.held(sg, part) as state:
                out.narrow(0, offset - slot.offset, numel).copy_(state.narrow(0, at, numel))
            out[-1] += 1
        if self.placement.sharded:
            self.dp.all_reduce_sum(out)  # each rank filled its own range, zeros elsewhere: every rank sees the count
        if part == "grad":
            if out[-1] == 0:
                return None
            out /= self.cur_scale
        return out[:-1].view(slot.shape)

    def set_full_state(self, param: torch.Tensor, part: str, value: torch.Tensor) -> None:
        """Rewrite `param`'s `part` (as `full_state` names them; "grad" scaled back as the step reads it) from
        `value`, its whole value in its shape; setting "master" sets the parameter too (in the compute dtype).
        Every rank calls it with the same value."""
        found = self._slot_of(param)
        if found is None:
            raise ValueError(f"this engine does not train the parameter of shape "
                             f"{tuple(getattr(param, 'ds_shape', param.shape))} (frozen, or not in the model it was "
                             "initialized with)")
        _check_part(part)
        unit, slot = found
        if tuple(value.shape) != tuple(slot.shape):
            raise ValueError(f"{slot.name}: a value of shape {tuple(value.shape)} for a parameter of shape "
                             f"{tuple(slot.shape)}")
        self._finish_step()
        flat = value.detach().reshape(-1).float().cpu()
        if part == "grad":
            flat = flat * self.cur_scale
        start = self.placement.rank_range(unit)[0]
        for sg, at, offset, numel in self._pieces(unit, slot.offset, slot.numel):
            fresh = part == "grad" and sg.grad_fresh  # a spent gradient: the rest of the sub-group is zero
            with self.driver.held(sg, part, dirty=True, overwrite=fresh) as state:
                if fresh:
                    state.zero_()
                state.narrow(0, at, numel).copy_(flat.narrow(0, offset - slot.offset, numel))
            if part == "grad":
                sg.grad_fresh, sg.norms = False, None
            elif part == "master":
                with self.placement.shard(unit, write=True) as shard:
                    shard.narrow(0, offset - start, numel).copy_(flat.narrow(0, offset - slot.offset, numel))
        if part == "master":
            self.placement.shards_changed()


def _check_part(part: str) -> None:
    if part not in (*STATE_PARTS, "grad"):
        raise ValueError(f"state part {part!r}: one of {', '.join((*STATE_PARTS, 'grad'))}")
