"""PartitionedPlacement (ZeRO-3): each unit's flat parameters live as this rank's shard in a tier, and are gathered
into a full buffer only while the unit's module runs (forward, then again for backward).

Each unit keeps one full buffer tensor whose storage holds no bytes while the unit is released: the
parameters stay views of it, and tensors autograd saved in forward (views too) see the bytes again once the
unit is re-gathered for backward (the storage gets its bytes back in place: full_bytes.py). A unit is
gathered by the forward pre-hook of its module and released by the forward hook; hooks on the module's outputs
gather it again when backward reaches them; when every parameter of the unit has its gradient, the gradient
is reduce-scattered into the shard, accumulated in fp32 by Gradients, and the unit is released. Gathers and
releases are counted, so a module called twice, activation checkpointing's recomputation, and nested use all
keep the bytes while anyone needs them.

A gather copies the shard into the full buffer on the device tier's copy stream (a Fill): the shard stays
pinned until the copy has landed, and the module's compute waits for the copy's event (without CUDA its thread
waits for the copy worker). The hooks learn the order units come in, forward and backward; while a unit
computes, the unit that came after it last time is prefetched (its fill started) where the device tier has
free room for it, so its gather only waits for its copy's event; in the first step, with no order seen, the next
block in the model's own order (forward) or the one before it (backward), not for frozen parts cut from a block.

A frozen unit (an adapter's base: parameters without gradients) moves the same way but is never written: its
shard is stored once, gathered, released clean. Its backward gives no gradient to wait for, so it ends when the
gradients of its module's inputs are computed, in the calls the backward has reached (an identity on them,
`_InputsDone`, fires then: every use of the frozen weights in the module's backward is behind it; a graph kept alive
without a backward holds nothing) and its module's trained units have theirs; where the inputs need no gradient
and nothing else ends it, at the backward's end.

A weight tied between an embedding and the head (tied_head.py) has the head's gradient kept on the host through
the blocks' backward and added back before its unit's reduction. A module holding root parameters called outside
the model's forward gathers the root unit around that call; where the device budget needs it, the root unit is
parked while the blocks run: held, its bytes given back until its next use (root_uses.py).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from tiering import BudgetExceededError, Handle, SwapManager, Tier

from ..comm import DataParallel
from ..optim.driver import AdamDriver, SubGroup
from ..optim.gradients import REDUCTION_SCRATCH, Gradients
from . import int8_weights
from .ds_param import ZeroParamStatus, set_status
from .flat_unit import FlatUnit
from .frozen import FrozenEnds, check_frozen, check_unwritten, join_ends
from .full_bytes import free_bytes, take_bytes
from .full_state_dict import full_values_hook
from .materialize import Materializer, host_empty
from .placement import Placement
from .root_uses import RootUses
from .tied_head import TiedHead, sent_this_backward, tied_heads
from .unit import GRADIENTS, Fill, Unit, UnitState


class PartitionedPlacement(Placement):
    sharded = True

    def __init__(self, *, swap: SwapManager, dp: DataParallel, device: torch.device, shard_tier: Tier,
                 gradients: Gradients | None, wait_for_update: Callable[[int], None] | None = None,
                 update_pending: Callable[[int], bool] | None = None):
        """`shard_tier`: where a shard is fetched to for gathering (host when it rests on host or nvme, the
        gather copying it to the device; device when it rests there). `gradients`: where each unit's gradient
        goes once its backward is done; None for inference (no backward hooks). `wait_for_update(index)`:
        returns once unit `index`'s shard holds the last optimizer step's values (overlap_step: a step may
        still run; a speculative step not yet validated is abandoned). `update_pending(index)`: whether
        `wait_for_update(index)` would wait or abandon (a prefetch then leaves the unit)."""
        self.swap = swap
        self.dp = dp
        self.device = device
        self.shard_tier = shard_tier
        self.gradients = gradients
        self.wait_for_update = wait_for_update or (lambda index: None)
        self.update_pending = update_pending or (lambda index: False)
        self.units: list[Unit] = []
        self.model_hooks: list = []
        self._after: dict[tuple[bool, int], int] = {}
        """(in backward, unit index) -> the index of the unit a hook gathered next, the last time."""
        self._last: tuple[bool, int] | None = None
        self._ended_after: dict[int, int] = {}
        """Unit index -> the unit whose forward ended just before this one's, the last forward outside a backward (a
        reentrant checkpoint's too): a backward reaches modules as their outputs' gradients come, the reverse of the
        order their forwards ended (the first backward's guess, `_next_in_order`)."""
        self._last_ended: int | None = None
        self._ahead: Unit | None = None
        """The unit prefetched for the next hook's gather."""
        self._trained_of: dict[int, list[Unit]] = {}
        """id(module) -> its trained units: the frozen units cut from the module end their backward after theirs."""
        self._frozen_ends: dict[int, FrozenEnds] = {}
        """id(module) -> the frozen units cut from its unit (frozen.py)."""
        self._tied: dict[int, list[TiedHead]] = {}
        """Unit index -> its weights tied between an embedding and the head (their head gradients)."""
        self._root_uses: RootUses | None = None
        """The root's uses outside the model's forward, and its parking (with park_root, in training)."""
        self._model: nn.Module | None = None

    @classmethod
    def build(cls, model: nn.Module, plan: list[tuple[FlatUnit, nn.Module]], *, materialize: Materializer,
              driver: AdamDriver | None, param_home: Tier, dtype: torch.dtype, sub_group_size: int, persistent: list[bool],
              masters_are_params: bool, int8_frozen: bool = False, park_root: bool = False,
              **collaborators) -> PartitionedPlacement:
        """Unit by unit: materialize (a model built on meta), flatten, keep this rank's shard (the fp32
        master, unless `masters_are_params`, and moments, and the compute-dtype parameter shard, each in its
        tier), and leave the parameters as views of an empty full buffer. Peak host memory is one unit plus
        the tiers' budgets. `driver` None (inference): no optimizer state. `int8_frozen`: frozen units' shards
        rest as block-wise int8 (int8_weights.py). `park_root`: the root unit parked between its uses, in training
        (root_uses.py). `collaborators`: the constructor's arguments."""
        shard_tier: Tier = "device" if param_home == "device" else "host"
        placement = cls(shard_tier=shard_tier, **collaborators)
        placement._model = model
        swap, device = placement.swap, placement.device
        for index, (flat, module) in enumerate(plan):
            materialize(*(f for f, m in plan if m is module))  # a module's units at once: it may hold several's
            if flat.frozen:
                check_frozen(flat, device)
            # fp32 for the optimizer's master; inference and frozen units keep the compute dtype alone.
            exact = driver is not None and not flat.frozen
            values = flat.flatten(host_empty((flat.padded_numel,), torch.float32 if exact else dtype))
            flat.unbind()  # the materialized parameters go: `values` holds them, one unit's worth at a time
            master = values.narrow(0, flat.shard_start, flat.shard_numel)
            segment = f"{flat.name or 'root'}/param"
            int8 = int8_frozen and flat.frozen
            if int8:
                stored = int8_weights.encode(master, torch.empty(int8_weights.stored_numel(flat.shard_numel),
                                                                 dtype=torch.uint8))
                swap.register(segment, dtype=torch.uint8, shape=stored.shape, home=param_home, data=stored,
                              frozen=True).wait()
            else:
                swap.register(segment, dtype=dtype, shape=(flat.shard_numel,), home=param_home,
                              data=master.to(dtype), frozen=flat.frozen or driver is None).wait()
            sub_groups = [] if not exact else driver.add_unit(
                index, flat.name or "root", master, flat.group, sub_group_size,
                segment if masters_are_params else None, start=flat.shard_start, extents=flat.extents)
            del values, master
            full = torch.empty(flat.padded_numel, dtype=dtype, device=device)
            placement._add(Unit(index, flat, module, full, sub_groups, segment, int8=int8,
                                persistent=persistent[index], state=UnitState.RELEASED))
        placement.model_hooks.append(model._register_state_dict_hook(
            full_values_hook(model, placement.units, placement.gather, placement.release)))
        placement._root_uses = RootUses(
            model, [u for u in placement.units if u.module is model], [u for u in placement.units if u.block is not model],
            enter=placement._enter, leave=placement._post_forward, parks=park_root and placement.gradients is not None,
            park=placement._park, unpark=placement._unpark,
            head_done=lambda p: sent_this_backward((h for t in placement._tied.values() for h in t), p))
        materialize.rest()
        for module in model.modules():  # buffers: to the device, in the dtype they were built in (a rotary
            for name, buffer in module.named_buffers(recurse=False):  # table's fp32, as DeepSpeed keeps it)
                if buffer.is_meta:
                    raise ValueError(f"buffer {name!r} of {type(module).__name__} is on the meta device: "
                                     "build it with real values (it is not a parameter, so it is not initialized)")
                setattr(module, name, buffer.to(device))
        return placement

    def _add(self, unit: Unit) -> None:
        unit.flat.bind(unit.full)
        unit.full.untyped_storage().resize_(0)
        unit.flat.unbind()  # released parameters hold no bytes a stray read could reach (they are 0-element)
        self.units.append(unit)
        if unit.frozen:
            join_ends(self._frozen_ends, unit, self._end_frozen)
        else:
            self._trained_of.setdefault(id(unit.module), []).append(unit)
        unit.hooks.append(unit.module.register_forward_pre_hook(lambda m, args: self._enter(unit)))
        post = unit.module.register_forward_hook(lambda m, args, out: self._post_forward(unit, out), always_call=True)
        unit.hooks.append(post)  # (always: a forward that raises releases the unit too)
        if self.gradients is not None and not unit.frozen:
            for slot in unit.flat.slots:
                unit.hooks.append(slot.param.register_post_accumulate_grad_hook(lambda p: self._grad_ready(unit)))
            tied = [TiedHead(self.swap, *found) for found in tied_heads(unit.module, unit.flat.slots)]
            if tied:
                self._tied[unit.index] = tied

    @contextlib.contextmanager
    def shard(self, unit: Unit, *, write: bool = False, overwrite: bool = False) -> Iterator[torch.Tensor]:
        if unit.fill is not None:
            unit.fill.settle()  # the shard is the fill's until its copy has read it
        overwrite = overwrite and not unit.int8  # an int8 shard is decoded whole: its scales are read
        with self.swap.held(unit.segment, self.shard_tier, dirty=write, overwrite=overwrite) as tensor:
            if not unit.int8:
                yield tensor
                return
            numel = unit.flat.shard_numel
            values = int8_weights.decode(tensor, numel, torch.empty(numel, dtype=unit.full.dtype, device=tensor.device))
            yield values
            if write:
                int8_weights.encode(values, tensor)

    # -- gather and release ------------------------------------------------------------------------------

    def gather(self, unit: Unit) -> None:
        self.wait_for_update(unit.index)
        if unit.parked:
            self._unpark(unit)
        elif unit.state is UnitState.STALE:
            self._refill(unit)
            unit.to("refill")
        elif not unit.gathered:
            if unit.state is UnitState.RELEASED:
                self._prefetch(unit)
            try:
                self._wait_fill(unit)
            except BaseException:  # never leave a unit looking gathered with bytes that were not filled
                self._drop(unit)
                raise
            unit.to("gather")
        unit.refs += 1

    def release(self, unit: Unit) -> None:
        unit.refs -= 1
        if unit.refs or unit.persistent or not unit.gathered:
            return
        if unit.parked:
            unit.parked = False  # its bytes went when it was parked
            unit.flat.unbind()
        else:
            free_bytes(self.swap, unit)
        unit.to("release")

    def frees_on_release(self, unit: Unit) -> bool:
        return unit.refs == 1 and not unit.persistent

    def _prefetch(self, unit: Unit) -> None:
        """Give a released unit's full buffer its bytes and start its fill."""
        take_bytes(self.swap, unit)
        try:
            unit.fill = self._start_fill(unit)
        except BaseException:
            free_bytes(self.swap, unit)
            raise
        unit.to("prefetch")

    def _park(self, unit: Unit) -> None:
        """Give back a held unit's bytes until its next use (root_uses.py); it stays held, its parameters bare views."""
        free_bytes(self.swap, unit, unbind=False)
        unit.parked = True
        set_status((slot.param for slot in unit.flat.slots), ZeroParamStatus.NOT_AVAILABLE)

    def _unpark(self, unit: Unit) -> None:
        """A parked unit's bytes again, filled from its shard (a step since refills a stale one)."""
        self.wait_for_update(unit.index)
        take_bytes(self.swap, unit)
        try:
            unit.fill = self._start_fill(unit)
            self._wait_fill(unit)
        except BaseException:  # parked as it was, once the fill has ended (it may be copying into the bytes)
            unit.fill.settle()
            free_bytes(self.swap, unit, unbind=False)
            raise
        unit.parked = False
        set_status((slot.param for slot in unit.flat.slots), ZeroParamStatus.AVAILABLE)
        if unit.state is UnitState.STALE:
            unit.to("refill")

    def _drop(self, unit: Unit) -> None:
        """Give back a prefetched unit's bytes (nobody gathered it, or its fill failed) once its fill has ended."""
        unit.fill.settle()
        free_bytes(self.swap, unit)
        unit.to("drop")

    def _refill(self, unit: Unit) -> None:  # a gathered unit's full buffer takes its shard's current values
        unit.fill = self._start_fill(unit)
        self._wait_fill(unit)

    def _start_fill(self, unit: Unit) -> Fill:
        """Copy the unit's shard into the full buffer (several ranks: into this rank's part, for the all-gather) on
        the copy stream, behind the compute queued so far, once the shard is in its tier (at once, or by the thread
        completing its read); the shard is released once the copy has landed (not evicted or reused before)."""
        tier = self.swap.device_tier
        after = tier.mark()
        flat = unit.flat
        dst = unit.full if self.dp.world_size == 1 else unit.full.narrow(0, flat.shard_start, flat.shard_numel)
        if unit.int8:
            dst = unit.staging  # decoded into the full buffer by `_wait_fill`
        fill = Fill(unit.name)
        start = time.perf_counter()
        fetched = self.swap.fetch(unit.segment, self.shard_tier)

        def landed(copied: Handle) -> None:  # after the shard's release (release_after's callback comes first)
            try:
                self.swap.timeline.add(unit.segment, f"{self.shard_tier}->device", start, time.perf_counter(),
                                       bytes=dst.numel() * dst.element_size())
            finally:
                fill.done.part_done(copied.error)

        def queue(fetch: Handle) -> None:
            if fetch.error is not None:  # the fetch failed and unpinned the shard: nothing to copy
                fill.queued.part_done(fetch.error)
                fill.done.part_done(fetch.error)
                return
            copied = Handle(label=f"copy into {unit.name or 'root'}")
            self.swap.release_after(unit.segment, copied)  # a gather meanwhile waits for it rather than fail
            copied.add_done_callback(landed)
            try:
                fill.copied = tier.copy(dst, self.swap.view(unit.segment), copied, after=after)
            except BaseException as exc:
                copied.part_done(exc)
                fill.queued.part_done(exc)
                return
            fill.queued.part_done()

        fetched.add_done_callback(queue)
        return fill

    def _wait_fill(self, unit: Unit) -> None:
        """The compute that follows waits for the unit's fill (host time spent waiting is counted as stall);
        with several ranks, the ranks' parts are then all-gathered."""
        start = time.perf_counter()
        unit.fill.wait()
        self.swap.note_stall(unit.segment, start, time.perf_counter())
        flat = unit.flat
        if unit.int8:  # on the compute stream, behind the copy's event
            int8_weights.decode(unit.staging, flat.shard_numel, unit.full.narrow(0, flat.shard_start, flat.shard_numel))
        if self.dp.world_size > 1:
            self.dp.all_gather(unit.full.narrow(0, flat.shard_start, flat.shard_numel), unit.full)

    # -- prefetch in the order the hooks see -----------------------------------------------------------------

    def _gather_in_order(self, unit: Unit) -> None:
        """Gather for a module's forward or backward hook, where units come in the model's order: note that
        order, and prefetch the unit that came after this one last time (in the first step, `_next_in_order`'s
        guess) while this one computes. A prefetched unit that does not come next is dropped."""
        fresh = not unit.gathered
        if fresh:
            key = (torch._C._current_graph_task_id() != -1, unit.index)  # backward runs the other way
            if key[0]:
                self._last_ended = None  # the next forward's order starts afresh
            if self._last is not None:
                self._after[self._last] = unit.index
            self._last = key
            if self._ahead is not unit:
                self._drop_ahead()
            self._ahead = None
        self.gather(unit)
        if fresh:
            self._prefetch_ahead(self._after.get(key, self._next_in_order(key)))

    def _next_in_order(self, key: tuple[bool, int]) -> int | None:
        """Where no unit has come after this one yet (the first forward and backward: no order seen), a guess, so that
        the first step reads ahead too (an inference's first token): another part of the same module (cut by param
        group: its hook runs next, either way); else in a forward the next in the list (the next block's first
        part; a block's frozen parts come in the order its modules are defined, most often the order it calls them:
        a wrong guess is dropped), in a backward the first part of the unit whose forward ended before this one's
        (its outputs' gradients come next)."""
        backward, index = key
        units = self.units
        if not backward or (index + 1 < len(units) and units[index + 1].module is units[index].module):
            return index + 1 if index + 1 < len(units) else None
        ended = self._ended_after.get(self._first_part(index))
        return None if ended is None else self._first_part(ended)

    def _first_part(self, index: int) -> int:
        """The index of the first unit of unit `index`'s module (units cut from one module by param group are
        adjacent); -1 stays -1."""
        while index > 0 and self.units[index - 1].module is self.units[index].module:
            index -= 1
        return index

    def _prefetch_ahead(self, index: int | None) -> None:
        if index is None:
            return
        unit = self.units[index]
        if unit.state is not UnitState.RELEASED or not self._room_for(unit):
            return
        if self.swap.moving(unit.segment) or self.update_pending(index):
            return  # its fetch (or its update) would be waited for here, before this unit computes: its gather will
        self.wait_for_update(index)
        try:
            self._prefetch(unit)
        except BudgetExceededError:
            return  # the host cannot take its shard beside what the backward holds now: its gather will wait for room
        self._ahead = unit

    def _room_for(self, unit: Unit) -> bool:
        """Whether prefetching `unit` fits in the device tier's free room (it never evicts) and the prefetch
        limits: the prefetch bucket (0 with prefetch off) and the live bytes cap (stage3_max_live_parameters).
        In a backward the room left includes the reduction's scratch not made yet (in the first backward, and the
        first after offload_states freed it: its first reductions make it, after this prefetch)."""
        tier, config = self.swap.device_tier, self.swap.config
        need = tier.charge(unit.nbytes)
        if unit.int8:  # and the stored bytes' staging (full_bytes.take_bytes)
            need += tier.charge(self.swap.segments[unit.segment].nbytes)
        free = tier.free_bytes()
        if free is not None and self.gradients is not None and torch._C._current_graph_task_id() != -1:
            free -= max(0, self.gradients.scratch_bytes - tier.reserved.get(REDUCTION_SCRATCH, 0))
        live = config.max_live_bytes
        return (need <= config.prefetch_bytes and (free is None or need <= free)
                and (live is None or tier.in_use + need <= live))

    def _drop_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.state is UnitState.PREFETCHED:
            self._drop(ahead)

    def shards_changed(self, *, stepped: bool = False) -> None:
        """Units still gathered (persistent ones) read the updated shards; a prefetched one is dropped."""
        self._drop_ahead()
        for unit in self.units:
            if unit.gathered and not unit.parked and not (stepped and unit.frozen):  # parked: filled at its next use
                self._refill(unit)
                if unit.state is UnitState.STALE:
                    unit.to("refill")

    def step_started(self) -> None:
        self._drop_ahead()
        for unit in self.units:
            if unit.state is UnitState.GATHERED and not unit.frozen:  # a step never writes a frozen shard
                unit.to("stepped")

    @contextlib.contextmanager
    def step_output(self, sg: SubGroup) -> Iterator[torch.Tensor]:
        unit = self.units[sg.unit]
        with super().step_output(sg) as out:
            yield out
            if sg is not unit.sub_groups[-1]:
                # The pass writes the rest of the shard next: written behind once it is whole, not once per
                # sub-group (the trace says its next use is far: each release would start a write of all of it).
                self.swap.expect_fetch(unit.segment)

    def step_segment(self, sg: SubGroup) -> str | None:
        unit = self.units[sg.unit]
        return None if sg.master_in is not None else unit.segment  # a master in the shard writes it as state

    def adopt_full(self, unit: Unit) -> None:
        with self.shard(unit, write=True) as shard:
            shard.copy_(unit.full.narrow(0, *self.rank_range(unit)))

    # -- hooks --------------------------------------------------------------------------------------------

    def _enter(self, unit: Unit) -> None:
        """The gather before a forward of the unit's module (or, for a root unit, of a module holding its parameters
        outside the model's forward: root_uses.py)."""
        (self._pre_forward_frozen if unit.frozen else self._pre_forward)(unit)

    def _pre_forward(self, unit: Unit) -> None:
        self._land_heads()  # (a recomputation inside the backward)
        if unit.block is not self._model:
            self._root_uses.block_forward()  # the root's bytes go before the block takes room
        recomputed = torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1
        if recomputed:
            self._reserve_gradients(unit)  # before the gather prefetches the next unit, as in _pre_backward
        self._gather_in_order(unit)
        unit.forwards += 1
        if recomputed:
            # Forward run inside backward (activation checkpointing's recomputation): non-reentrant checkpointing
            # stops it as soon as it has its saved tensors, so the forward hook may never run: backward drops it.
            unit.backward_refs += 1
            self._arm(unit)

    def _pre_forward_frozen(self, unit: Unit) -> None:
        """A frozen unit's gather, its parameters' versions noted (a forward writing one is an error at its end)."""
        self._pre_forward(unit)
        unit.versions = [slot.param._version for slot in unit.flat.slots]

    def _end_frozen(self, ends: FrozenEnds) -> None:
        """End the backward of the frozen units cut from a module once its inputs' gradients are computed (in every
        call a backward has reached: frozen.py) and its trained units have their gradients (both may still need their
        weights before). Not the root's (finish_backward ends them): its inputs (token ids) guard nothing, and its
        weights pass gradients on to the blocks after."""
        if ends.module is not self._model and not ends.inputs_pending and all(
                t.state is not UnitState.BACKWARD for t in self._trained_of.get(id(ends.module), ())):
            for unit in ends.units:
                if unit.state is UnitState.BACKWARD:
                    self._finish_backward(unit)

    def _post_forward(self, unit: Unit, output: object) -> object:
        """Arm the unit's backward on its outputs and drop the forward's gather. Returns the output the module's
        caller gets: any output that is a view of the unit's parameters (a bias returned as it is) becomes a copy,
        since the release takes those bytes away (reading them after would read freed memory)."""
        if not unit.forwards:  # (always called) its pre-hook raised before the gather: nothing to drop
            return output
        unit.forwards -= 1
        if unit.frozen:
            check_unwritten(unit, self.release)
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside the backward
            if self._last_ended is not None:
                self._ended_after[unit.index] = self._last_ended
            self._last_ended = unit.index
        leaves, spec = tree_flatten(output)
        storage = unit.full.untyped_storage().data_ptr()
        if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == storage for t in leaves):
            output = tree_unflatten([t.clone() if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr()
                                     == storage else t for t in leaves], spec)
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
                return output  # recomputation inside backward: _pre_forward handed its gather to backward
        self.release(unit)
        return output

    def _land_heads(self) -> None:
        """A head gradient's copy to the host, started by the backward just before: its device room comes back
        before the next unit takes any."""
        for tied in self._tied.values():
            for head in tied:
                head.land()

    def _pre_backward(self, unit: Unit) -> None:
        if self.gradients is None:  # zero.inference's: nothing would release the unit after the backward
            raise RuntimeError(f"unit {unit.name!r}: an inference engine runs forwards only (no backward)")
        self._land_heads()
        if unit.block is not self._model:
            self._root_uses.block_backward()
        self._reserve_gradients(unit)  # before the gather prefetches the next unit: the gradients come first
        self._gather_in_order(unit)
        unit.backward_refs += 1
        self._arm(unit)

    def _arm(self, unit: Unit) -> None:
        if unit.state is not UnitState.BACKWARD:
            self._reserve_gradients(unit)
            unit.to("arm")
            unit.grads_pending = 0 if unit.frozen else len(unit.flat.slots)

    def _reserve_gradients(self, unit: Unit) -> None:
        """Count autograd's gradients of the unit's parameters (as large as its full buffer) until its reduce."""
        if not unit.grads_reserved and not unit.frozen:
            self.swap.reserve_device(unit.nbytes, f"{unit.name} gradients", GRADIENTS)
            unit.grads_reserved = True

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
        if not unit.frozen:
            for head in self._tied.get(unit.index, ()):
                head.add_back()
            last = self.gradients.reduce(unit)  # frees the parameters' gradients
            self.swap.unreserve_device(unit.nbytes, GRADIENTS)
            unit.grads_reserved = False
            if last and unit.sub_groups and unit.sub_groups[0].master_in is None:
                # The step that follows rewrites the shard from the fp32 masters: its room is the first to give
                # up, for the gradients coming and the step's state (written home already, it costs no write).
                self.swap.expect_overwrite(unit.segment)
        while unit.backward_refs:
            unit.backward_refs -= 1
            self.release(unit)
        if not unit.frozen and id(unit.module) in self._frozen_ends:
            self._end_frozen(self._frozen_ends[id(unit.module)])

    def backward_again(self, unit: Unit) -> None:
        """The unit's backward runs once more while it stays gathered (the unit-major schedule's next micro-batch
        slice): its gradients are awaited, and counted, again."""
        self._arm(unit)

    def finish_unit_backward(self, unit: Unit) -> None:
        """The unit's backward is over (the unit-major schedule's slice): reduce its gradients now, where some
        parameter got none (unused in it)."""
        if unit.state is UnitState.BACKWARD:
            self._finish_backward(unit)

    def finish_backward(self) -> None:
        """Reduce units some of whose parameters got no gradient (unused in this forward), drop every
        reference backward still holds, and a prefetched unit backward did not gather."""
        self._drop_ahead()
        for unit in self.units:
            if unit.state is UnitState.BACKWARD:
                self._finish_backward(unit)
        for ends in self._frozen_ends.values():
            ends.backward_over()
        self.gradients.drain()

    def close(self) -> None:
        self._drop_ahead()
        for unit in self.units:
            if unit.fill is not None:
                unit.fill.settle()  # no copy or shard release may outlive the swap manager
        for hook in self.model_hooks:
            hook.remove()
        self.model_hooks.clear()
        for unit in self.units:
            for hook in unit.hooks:
                hook.remove()
            unit.hooks.clear()
        for tied in self._tied.values():
            for head in tied:
                head.close()
        self._tied.clear()
        if self._root_uses is not None:
            self._root_uses.close()

