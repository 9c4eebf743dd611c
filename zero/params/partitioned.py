"""PartitionedPlacement (ZeRO-3): each unit's flat parameters live as this rank's shard in a tier, and are gathered
into a full buffer only while the unit's module runs (forward, then again for backward).

Each unit keeps one full buffer tensor whose storage is resized to zero when the unit is released: the
parameters stay views of it, and tensors autograd saved in forward (views too) see the bytes again once the
unit is re-gathered for backward. A unit is gathered by the forward pre-hook of its module and released by
the forward hook; hooks on the module's outputs gather it again when backward reaches them; when every
parameter of the unit has its gradient, the gradient is reduce-scattered into the shard, accumulated in fp32
by Gradients, and the unit is released. Gathers and releases are counted, so a module called twice,
activation checkpointing's recomputation, and nested use all keep the bytes while anyone needs them.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from tiering import SwapManager, Tier

from ..comm import DataParallel
from ..optim.driver import AdamDriver
from ..optim.gradients import Gradients
from .flat_unit import FlatUnit
from .materialize import Materializer, host_empty
from .placement import Placement
from .unit import Unit, UnitState


class PartitionedPlacement(Placement):
    sharded = True

    def __init__(self, *, swap: SwapManager, dp: DataParallel, device: torch.device, shard_tier: Tier,
                 gradients: Gradients | None, wait_for_update: Callable[[int], None] | None = None):
        """`shard_tier`: where a shard is fetched to for gathering (host when it rests on host or nvme, the
        gather copying it to the device; device when it rests there). `gradients`: where each unit's gradient
        goes once its backward is done; None for inference (no backward hooks). `wait_for_update(index)`:
        returns once unit `index`'s shard holds the last optimizer step's values (overlap_step: a step may
        still run)."""
        self.swap = swap
        self.dp = dp
        self.device = device
        self.shard_tier = shard_tier
        self.gradients = gradients
        self.wait_for_update = wait_for_update or (lambda index: None)
        self.units: list[Unit] = []
        self.model_hooks: list = []

    @classmethod
    def build(cls, model: nn.Module, plan: list[tuple[FlatUnit, nn.Module]], *, materialize: Materializer,
              driver: AdamDriver | None, param_home: Tier, dtype: torch.dtype, sub_group_size: int, persistence_threshold: int,
              masters_are_params: bool, **collaborators) -> PartitionedPlacement:
        """Unit by unit: materialize (a model built on meta), flatten, keep this rank's shard (the fp32
        master, unless `masters_are_params`, and moments, and the compute-dtype parameter shard, each in its
        tier), and leave the parameters as views of an empty full buffer. Peak host memory is one unit plus
        the tiers' budgets. `driver` None (inference): no optimizer state. `collaborators`: the constructor's
        arguments."""
        shard_tier: Tier = "device" if param_home == "device" else "host"
        placement = cls(shard_tier=shard_tier, **collaborators)
        swap, device = placement.swap, placement.device
        for index, (flat, module) in enumerate(plan):
            materialize(flat)
            # fp32 for the optimizer's master; inference keeps the compute dtype alone.
            values = flat.flatten(host_empty((flat.padded_numel,), dtype if driver is None else torch.float32))
            flat.unbind()  # the materialized parameters go: `values` holds them, one unit's worth at a time
            master = values.narrow(0, flat.shard_start, flat.shard_numel)
            segment = f"{flat.name or 'root'}/param"
            swap.register(segment, dtype=dtype, shape=(flat.shard_numel,), home=param_home,
                          data=master.to(dtype)).wait()
            sub_groups = [] if driver is None else driver.add_unit(
                index, flat.name or "root", master, flat.group, sub_group_size,
                segment if masters_are_params else None)
            del values, master
            full = torch.empty(flat.padded_numel, dtype=dtype, device=device)
            placement._add(Unit(index, flat, module, full, sub_groups, segment,
                                persistent=flat.numel <= persistence_threshold, state=UnitState.RELEASED))
        placement.model_hooks.append(model._register_state_dict_hook(placement._state_dict_hook(model)))
        materialize.rest()
        for module in model.modules():  # buffers: to the device, floating ones in the compute dtype
            for name, buffer in module.named_buffers(recurse=False):
                if buffer.is_meta:
                    raise ValueError(f"buffer {name!r} of {type(module).__name__} is on the meta device: "
                                     "build it with real values (it is not a parameter, so it is not initialized)")
                setattr(module, name, buffer.to(device, dtype if buffer.is_floating_point() else buffer.dtype))
        return placement

    def _add(self, unit: Unit) -> None:
        unit.flat.bind(unit.full)
        unit.full.untyped_storage().resize_(0)
        unit.flat.unbind()  # released parameters hold no bytes a stray read could reach (they are 0-element)
        self.units.append(unit)
        unit.hooks.append(unit.module.register_forward_pre_hook(lambda m, args: self._pre_forward(unit)))
        unit.hooks.append(unit.module.register_forward_hook(lambda m, args, out: self._post_forward(unit, out)))
        if self.gradients is not None:
            for slot in unit.flat.slots:
                unit.hooks.append(slot.param.register_post_accumulate_grad_hook(lambda p: self._grad_ready(unit)))

    @contextlib.contextmanager
    def shard(self, unit: Unit, *, write: bool = False, overwrite: bool = False) -> Iterator[torch.Tensor]:
        with self.swap.held(unit.segment, self.shard_tier, dirty=write, overwrite=overwrite) as tensor:
            yield tensor

    # -- gather and release ------------------------------------------------------------------------------

    def gather(self, unit: Unit) -> None:
        self.wait_for_update(unit.index)
        if unit.state is UnitState.STALE:
            self._fill(unit)
            unit.to("refill")
        elif unit.state is UnitState.RELEASED:
            self.swap.reserve_device(unit.nbytes, unit.name)
            unit.full.untyped_storage().resize_(unit.nbytes)
            unit.flat.bind(unit.full)
            try:
                self._fill(unit)
            except BaseException:  # never leave a unit looking gathered with bytes that were not filled
                unit.full.untyped_storage().resize_(0)
                unit.flat.unbind()
                self.swap.unreserve_device(unit.nbytes)
                raise
            unit.to("gather")
        unit.refs += 1

    def _fill(self, unit: Unit) -> None:
        """Copy (one rank) or all-gather (several) the unit's shards into its full buffer."""
        with self.shard(unit) as shard:
            if self.dp.world_size == 1:
                unit.full.copy_(shard, non_blocking=shard.is_pinned())
            else:
                self.dp.all_gather(shard.to(self.device, non_blocking=True), unit.full)

    def release(self, unit: Unit) -> None:
        unit.refs -= 1
        if unit.refs or unit.persistent or not unit.gathered:
            return
        if unit.full.is_cuda:
            unit.full.record_stream(torch.cuda.current_stream())
        unit.full.untyped_storage().resize_(0)
        unit.flat.unbind()
        self.swap.unreserve_device(unit.nbytes)
        unit.to("release")

    def shards_changed(self) -> None:
        """Units still gathered (persistent ones) read the updated shards."""
        for unit in self.units:
            if unit.gathered:
                self._fill(unit)
                if unit.state is UnitState.STALE:
                    unit.to("refill")

    def step_started(self) -> None:
        for unit in self.units:
            if unit.state is UnitState.GATHERED:
                unit.to("stepped")

    def adopt_full(self, unit: Unit) -> None:
        with self.shard(unit, write=True) as shard:
            shard.copy_(unit.full.narrow(0, *self.rank_range(unit)))

    # -- hooks --------------------------------------------------------------------------------------------

    def _pre_forward(self, unit: Unit) -> None:
        self.gather(unit)
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1:
            # Forward run inside backward (activation checkpointing's recomputation): the saved tensors it
            # makes are used right away, and non-reentrant checkpointing stops the recomputation as soon as
            # it has them, so the forward hook may never run: this gather is backward's to drop.
            unit.backward_refs += 1
            self._arm(unit)

    def _post_forward(self, unit: Unit, output: object) -> None:
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            armed = [False]

            def pre_backward(grad: torch.Tensor) -> None:
                if not armed[0]:  # once per forward call, whichever output's gradient comes first
                    armed[0] = True
                    self._pre_backward(unit)

            for t in tensors:
                t.register_hook(pre_backward)
            if torch._C._current_graph_task_id() != -1:
                return  # recomputation inside backward: _pre_forward handed its gather to backward
        self.release(unit)

    def _pre_backward(self, unit: Unit) -> None:
        self.gather(unit)
        unit.backward_refs += 1
        self._arm(unit)

    def _arm(self, unit: Unit) -> None:
        if unit.state is not UnitState.BACKWARD:
            unit.to("arm")
            unit.grads_pending = len(unit.flat.slots)

    def _grad_ready(self, unit: Unit) -> None:
        if unit.state is not UnitState.BACKWARD:  # a parameter used outside its module's forward got a gradient first
            self.gather(unit)
            unit.backward_refs += 1
            self._arm(unit)
        unit.grads_pending -= 1
        if unit.grads_pending == 0:
            self._finish_backward(unit)

    def _finish_backward(self, unit: Unit) -> None:
        unit.to("grads_ready")
        self.gradients.reduce(unit)
        while unit.backward_refs:
            unit.backward_refs -= 1
            self.release(unit)

    def finish_backward(self) -> None:
        """Reduce units some of whose parameters got no gradient (unused in this forward), and drop every
        reference backward still holds."""
        for unit in self.units:
            if unit.state is UnitState.BACKWARD:
                self._finish_backward(unit)

    def _state_dict_hook(self, model: nn.Module):
        """A state_dict hook for `model` that fills the entries of partitioned parameters with their full
        values, one unit gathered at a time (the entries torch put there are views of empty storage)."""
        def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
            keys: dict[int, list[str]] = {}
            for name, p in model.named_parameters(remove_duplicate=False):
                keys.setdefault(id(p), []).append(prefix + name)
            for unit in self.units:
                self.gather(unit)
                try:
                    for slot in unit.flat.slots:
                        value = slot.param.detach().clone()
                        for key in keys.get(id(slot.param), ()):
                            if key in state_dict:
                                state_dict[key] = value
                finally:
                    self.release(unit)
        return hook

    def close(self) -> None:
        for hook in self.model_hooks:
            hook.remove()
        self.model_hooks.clear()
        for unit in self.units:
            for hook in unit.hooks:
                hook.remove()
            unit.hooks.clear()
