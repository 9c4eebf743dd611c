"""ResidentPlacement (stages 0-2): every unit's full flat buffer stays on the device for the whole run, the
parameters views into it. This rank steps its range (its shard from stage 1 on, all of it for stage 0) and,
where ranks step different shards, the updated shards are all-gathered back into every rank's buffer."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..comm import DataParallel
from ..optim.driver import AdamDriver
from ..optim.gradients import Gradients
from .flat_unit import FlatUnit
from .materialize import Materializer
from .placement import Placement
from .unit import Unit


class ResidentPlacement(Placement):
    def __init__(self, units: list[Unit], *, dp: DataParallel, gradients: Gradients, sharded: bool):
        self.units = units
        self.dp = dp
        self.gradients = gradients
        self.sharded = sharded

    @classmethod
    def build(cls, model: nn.Module, plan: list[tuple[FlatUnit, nn.Module]], *, materialize: Materializer,
              driver: AdamDriver, gradients: Gradients, dp: DataParallel, device: torch.device, dtype: torch.dtype,
              sharded: bool, sub_group_size: int) -> ResidentPlacement:
        """Materialize the model where it was built on meta, move it to the device, and make each unit's
        fp32 master (this rank's range) from the parameters' values before the cast to the compute dtype
        (parameters only: floating buffers keep the dtype they were built in)."""
        for flat, _ in plan:
            materialize(flat)
        materialize.rest()
        model.to(device)
        masters = [flat.flatten(torch.empty(flat.padded_numel, dtype=torch.float32, device=device))
                   for flat, _ in plan]
        for param in model.parameters():  # buffers keep their dtype (a rotary table's fp32), as DeepSpeed keeps them
            if param.is_floating_point():
                param.data = param.data.to(dtype)
        units = []
        for index, ((flat, module), master) in enumerate(zip(plan, masters)):
            full = master.to(dtype)
            flat.bind(full)
            start, numel = flat.rank_range(sharded)
            sub_groups = driver.add_unit(index, flat.name or "root", master.narrow(0, start, numel).cpu(),
                                         flat.group, sub_group_size, start=start, extents=flat.extents)
            units.append(Unit(index, flat, module, full, sub_groups))
        return cls(units, dp=dp, gradients=gradients, sharded=sharded)

    def shard(self, unit: Unit, *, write: bool = False, overwrite: bool = False):
        return contextlib.nullcontext(unit.full.narrow(0, *self.rank_range(unit)))

    def gather(self, unit: Unit) -> None:
        pass  # always gathered

    def release(self, unit: Unit) -> None:
        pass

    def finish_backward(self) -> None:
        for unit in self.units:
            self.gradients.reduce(unit)
        self.gradients.drain()

    def shards_changed(self, *, stepped: bool = False) -> None:
        if not self.sharded or self.dp.world_size == 1:
            return  # every rank stepped the whole buffer
        for unit in self.units:
            flat = unit.flat
            self.dp.all_gather(unit.full.narrow(0, flat.shard_start, flat.shard_numel).clone(), unit.full)
