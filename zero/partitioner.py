"""ZeRO-3 partitioner: each unit's flat parameters live as this rank's shard in a tier, and are gathered
into a full buffer only while the unit's module runs (forward, then again for backward).

Each unit keeps one full buffer tensor whose storage is resized to zero when the unit is released: the
parameters stay views of it, and tensors autograd saved in forward (views too) see the bytes again once the
unit is re-gathered for backward. A unit is gathered by the forward pre-hook of its module and released by
the forward hook; hooks on the module's outputs gather it again when backward reaches them; when every
parameter of the unit has its gradient, the gradient is reduce-scattered into the shard, accumulated in fp32
by the AdamDriver, and the unit is released. Gathers and releases are counted, so a module called twice,
activation checkpointing's recomputation, and nested use all keep the bytes while anyone needs them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from tiering import SwapManager, Tier

from .comm import DataParallel
from .flat_unit import FlatUnit


@dataclass(eq=False)
class PartitionedUnit:
    flat: FlatUnit
    module: nn.Module
    segment: str
    """Swap-manager segment holding this rank's shard in the compute dtype."""
    full: torch.Tensor
    """The gathered buffer (padded_numel elements); its storage has size 0 while released."""
    index: int
    """Position in the engine's unit list (sub-groups point back to it)."""
    persistent: bool = False
    """Small enough to stay gathered once gathered (stage3_param_persistence_threshold)."""
    refs: int = 0
    grads_pending: int = 0
    backward_armed: bool = False
    backward_refs: int = 0
    hooks: list = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.flat.padded_numel * self.full.element_size()

    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0


class Partitioner:
    def __init__(self, manager: SwapManager, dp: DataParallel, device: torch.device, shard_tier: Tier,
                 reduce_grads):
        self.manager = manager
        self.dp = dp
        self.device = device
        self.shard_tier = shard_tier
        """Where a shard is fetched to for gathering: host when it rests on host or nvme (the gather copies it
        to the device), device when it rests there."""
        self.reduce_grads = reduce_grads
        """engine callback: (unit, flat gradient in the compute dtype) -> accumulate this rank's shard."""
        self.wait_for_update: Callable[[int], None] = lambda index: None
        """engine callback: return once unit `index`'s shard holds the last optimizer step's values (a step
        may still be running on another thread)."""
        self.stale: set[int] = set()
        """Units gathered across a step run on another thread: refilled from their shard at the next gather."""
        self.units: list[PartitionedUnit] = []
        self.model_hooks: list = []

    def add(self, flat: FlatUnit, module: nn.Module, segment: str, dtype: torch.dtype, index: int,
            persistent: bool) -> PartitionedUnit:
        full = torch.empty(flat.padded_numel, dtype=dtype, device=self.device)
        flat.bind(full)
        full.untyped_storage().resize_(0)
        flat.unbind()  # released parameters hold no bytes a stray read could reach (they are 0-element)
        unit = PartitionedUnit(flat, module, segment, full, index, persistent)
        self.units.append(unit)
        unit.hooks.append(module.register_forward_pre_hook(lambda m, args: self._pre_forward(unit)))
        unit.hooks.append(module.register_forward_hook(lambda m, args, out: self._post_forward(unit, out)))
        for slot in flat.slots:
            unit.hooks.append(slot.param.register_post_accumulate_grad_hook(lambda p: self._grad_ready(unit)))
        return unit

    # -- gather and release ------------------------------------------------------------------------------

    def gather(self, unit: PartitionedUnit) -> None:
        self.wait_for_update(unit.index)
        if unit.index in self.stale:
            self.stale.discard(unit.index)
            if unit.gathered:
                self._fill(unit)
        if not unit.gathered:
            self.manager.reserve_device(unit.nbytes, unit.flat.name)
            unit.full.untyped_storage().resize_(unit.nbytes)
            unit.flat.bind(unit.full)
            try:
                self._fill(unit)
            except BaseException:  # never leave a unit looking gathered with bytes that were not filled
                unit.full.untyped_storage().resize_(0)
                unit.flat.unbind()
                self.manager.unreserve_device(unit.nbytes)
                raise
        unit.refs += 1

    def _fill(self, unit: PartitionedUnit) -> None:
        """Copy (one rank) or all-gather (several) the unit's shards into its full buffer."""
        shard = self.manager.acquire(unit.segment, self.shard_tier)
        try:
            if self.dp.world_size == 1:
                unit.full.copy_(shard, non_blocking=shard.is_pinned())
            else:
                self.dp.all_gather(shard.to(self.device, non_blocking=True), unit.full)
        finally:
            self.manager.release(unit.segment)

    def release(self, unit: PartitionedUnit) -> None:
        unit.refs -= 1
        if unit.refs or unit.persistent or not unit.gathered:
            return
        if unit.full.is_cuda:
            unit.full.record_stream(torch.cuda.current_stream())
        unit.full.untyped_storage().resize_(0)
        unit.flat.unbind()
        self.manager.unreserve_device(unit.nbytes)

    # -- hooks --------------------------------------------------------------------------------------------

    def _pre_forward(self, unit: PartitionedUnit) -> None:
        self.gather(unit)
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1:
            # Forward run inside backward (activation checkpointing's recomputation): the saved tensors it
            # makes are used right away, and non-reentrant checkpointing stops the recomputation as soon as
            # it has them, so the forward hook may never run: this gather is backward's to drop.
            unit.backward_refs += 1
            self._arm(unit)

    def _post_forward(self, unit: PartitionedUnit, output: object) -> None:
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

    def _pre_backward(self, unit: PartitionedUnit) -> None:
        self.gather(unit)
        unit.backward_refs += 1
        self._arm(unit)

    def _arm(self, unit: PartitionedUnit) -> None:
        if not unit.backward_armed:
            unit.backward_armed = True
            unit.grads_pending = len(unit.flat.slots)

    def _grad_ready(self, unit: PartitionedUnit) -> None:
        if not unit.backward_armed:
            self._arm(unit)  # a parameter used outside its module's forward got a gradient first
            self.gather(unit)
            unit.backward_refs += 1
        unit.grads_pending -= 1
        if unit.grads_pending == 0:
            self._finish_backward(unit)

    def _finish_backward(self, unit: PartitionedUnit) -> None:
        unit.backward_armed = False
        self.reduce_grads(unit)
        while unit.backward_refs:
            unit.backward_refs -= 1
            self.release(unit)

    def finish_backward(self) -> None:
        """After loss.backward(): reduce units some of whose parameters got no gradient (unused in this
        forward), and drop every reference backward still holds."""
        for unit in self.units:
            if unit.backward_armed:
                self._finish_backward(unit)

    def state_dict_hook(self, model: nn.Module):
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

    def remove_hooks(self) -> None:
        for hook in self.model_hooks:
            hook.remove()
        self.model_hooks.clear()
        for unit in self.units:
            for hook in unit.hooks:
                hook.remove()
            unit.hooks.clear()

    def refresh(self, index: int | None = None) -> None:
        """Re-read the shards of units that stay gathered across the optimizer step (persistent ones); with
        `index`, of that unit only."""
        for unit in self.units if index is None else [self.units[index]]:
            if unit.gathered:
                self._fill(unit)
