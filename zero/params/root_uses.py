"""The root unit's uses: gathered where its holders run outside the model's forward, and parked between its uses.

The root unit holds what no block holds (the embeddings, the final norm, the head) and follows the model's forward.
A script may call a module holding root parameters outside it (`model.get_input_embeddings()(ids)` passed on as
`inputs_embeds`, the head applied in a custom loss, the inner model called alone): there its units are gathered
around that call as around the model's forward (the placement's forward hooks, `enter` and `leave`), so its
backward gathers them again and its gradient reaches their reduction like any other. Inside the model's forward
nothing changes.

The root unit is used at both ends of a step: the embeddings at the forward's start; the head at its end and again
at the backward's start; the embeddings' gradient at the backward's end. Held gathered all the while, its full
buffer (with a tied embedding, the model's largest matrix) sits on the device beside every block. Where parking is
on it is parked instead: its bytes given back when the first block's forward begins and gathered again when a
module holding root parameters runs next (the head); in the backward given back once the parameters of the modules
that ran after the blocks have their gradients (the head's backward is over: a tied head's part has gone to the
host), and gathered again before the backward of a module that ran before the blocks and reads its weight there (a
Linear: an embedding's backward reads none). A use outside the model's forward is not recorded: its own backward
gathers the root again (a parked one is unparked), and blocks run outside the model's forward park nothing.

What the module hooks do not foresee is watched for while a forward has parked it (a torch function mode): a root
parameter read outside the modules that hold it (inside a block, by the model's own forward) gathers it again and
ends parking for the run, since its backward would read the weight at a point nobody marked. A model that holds
root parameters itself, or whose module holding them encloses a block, is never parked; nor is a persistent unit,
nor anything while no gradient is recorded (inference keeps its own weights between forwards).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .holders import readers
from .unit import Unit, UnitState


def parkable(model: nn.Module, root_params: list[nn.Parameter], block_modules: list[nn.Module]) -> bool:
    """Whether the root can be parked at all (its uses are seen): the model holds none of its parameters itself
    and no module holding them encloses a block."""
    owners = {owner for read in readers(model, root_params).values() for owner in read}
    blocks = {id(m) for m in block_modules}
    return bool(owners) and model not in owners and not any(
        id(m) in blocks for owner in owners for m in owner.modules())


class RootUses:
    """Gathers the root units (`roots`: those following the model's forward) around their holders' calls outside the
    model's forward (`enter(unit)`, `leave(unit, output) -> output`: the placement's forward hooks), and where `parks`
    (training, zero_tiering.park_root) parks and unparks them (`park`, `unpark`: the placement's) as the step's hooks
    report uses. `head_done(param)`: whether a tied head's backward has sent that parameter's head gradient this
    backward."""

    def __init__(self, model: nn.Module, roots: list[Unit], blocks: list[Unit], *, enter: Callable[[Unit], None],
                 leave: Callable[[Unit, object], object], parks: bool, park: Callable[[Unit], None],
                 unpark: Callable[[Unit], None], head_done: Callable[[nn.Parameter], bool]):
        self.enter, self.leave = enter, leave
        self.park, self.unpark, self.head_done = park, unpark, head_done
        self.moving = False  # parking or unparking: its own reads are not the model's
        self.depth = 0  # calls of the model's forward running
        self.roots = [u for u in roots if not u.persistent]  # (parked ones)
        self.unit_of = {id(slot.param): unit for unit in self.roots for slot in unit.flat.slots}
        self.params_of: dict[nn.Module, list[nn.Parameter]] = {}
        """Each module holding root parameters (or a container of them) -> those parameters (persistent units' too)."""
        self.owned: dict[nn.Module, list[Unit]] = {}
        """Each of those modules -> the root units its parameters are in."""
        slots = {id(slot.param): (slot.param, unit) for unit in roots for slot in unit.flat.slots}
        for pid, read in readers(model, [param for param, _ in slots.values()]).items():
            param, unit = slots[pid]
            for owner in read:
                self.params_of.setdefault(owner, []).append(param)
                if unit not in self.owned.setdefault(owner, []):
                    self.owned[owner].append(unit)
        params = [slot.param for unit in self.roots for slot in unit.flat.slots]
        self.enabled = parks and parkable(model, params, [b.module for b in blocks])
        self.reads = _UnforeseenReads(self)
        self.watching = False
        self._begin()
        self.hooks = [model.register_forward_pre_hook(lambda m, args: self._model_begins(), prepend=True),
                      model.register_forward_hook(lambda m, args, out: self._model_ends(), prepend=True, always_call=True)]
        for owner in self.owned:
            if owner is not model:  # (the pre-hook first: a tied head reads the weight in its own)
                self.hooks += [owner.register_forward_pre_hook(lambda m, args: self._owner_begins(m), prepend=True),
                               owner.register_forward_hook(self._owner_ends, always_call=True)]
        if not self.enabled:
            return
        for unit in self.roots:
            for slot in unit.flat.slots:
                if slot.param.requires_grad:
                    self.hooks.append(slot.param.register_post_accumulate_grad_hook(self._grad_landed))

    def _model_begins(self) -> None:
        self.depth += 1
        self._begin()

    def _model_ends(self) -> None:
        self.depth -= 1
        self._stop_watching()

    def _begin(self) -> None:
        """A forward of the model begins: its uses are noted afresh (a forward without gradients, or one that
        activation checkpointing runs without them inside a training forward, notes none)."""
        self._stop_watching()
        self.training = torch.is_grad_enabled()
        self.blocks_begun = False
        self.parked_in_forward = False
        self.between = False  # a root module ran between two blocks
        self.tail: list[nn.Module] = []
        self.inside: list[nn.Module] = []
        self.landed: set[int] = set()

    def _move(self, how: Callable[[Unit], None], unit: Unit) -> None:
        self.moving = True
        try:
            how(unit)
        finally:
            self.moving = False

    def _recording(self) -> bool:
        """Whether uses are noted: parking on, in a training forward of the model (not a recomputation in the backward)."""
        return self.enabled and self.training and self.depth > 0 and torch._C._current_graph_task_id() == -1

    # -- the forward ------------------------------------------------------------------------------------------

    def block_forward(self) -> None:
        """A block's forward begins (not a recomputation inside the backward)."""
        if not self.depth and torch._C._current_graph_task_id() == -1:
            self.parked_in_forward = False  # blocks run outside the model's forward: their backward parks nothing
        if not self._recording():
            return
        if self.tail:
            self.between = True
        if self.blocks_begun:
            return
        self.blocks_begun = True
        for unit in self.roots:
            if unit.state is UnitState.GATHERED and not unit.parked and unit.refs == 1:
                self._move(self.park, unit)
                self.parked_in_forward = True
        if self.parked_in_forward:
            self.reads.__enter__()
            self.watching = True

    def _owner_begins(self, owner: nn.Module) -> None:
        if not self.depth:  # outside the model's forward: gathered for this call (a parked one is unparked)
            for unit in self.owned[owner]:
                self.enter(unit)
            return
        for unit in self.owned[owner]:
            if unit.parked:
                self._move(self.unpark, unit)
        self.inside.append(owner)
        if not self._recording():
            return
        if self.blocks_begun:
            self.tail.append(owner)

    def _owner_ends(self, owner: nn.Module, args, output) -> object:
        if not self.depth:
            for unit in reversed(self.owned[owner]):
                output = self.leave(unit, output)
            return output
        if self.inside and self.inside[-1] is owner:
            self.inside.pop()
        if not self._recording() or self.blocks_begun or isinstance(owner, nn.Embedding):
            return None
        # Ran before the blocks and reads its weights in its backward: gathered again when its backward comes.
        for value in tree_flatten(output)[0]:
            if isinstance(value, torch.Tensor) and value.requires_grad:
                value.register_hook(lambda grad: self._lead_backward(owner))
        return None

    def _lead_backward(self, owner: nn.Module) -> None:
        for unit in self.owned[owner]:
            if unit.parked:
                self._move(self.unpark, unit)

    def unforeseen_read(self, param: nn.Parameter) -> None:
        """A root parameter read outside the modules holding it: gathered again, and parked no more."""
        if self.inside and any(param is p for p in self.params_of[self.inside[-1]]):
            return
        self.enabled = False  # (the mode leaves the stack at the forward's end: not from inside its own call)
        for unit in self.roots:
            if unit.parked:
                self._move(self.unpark, unit)

    def _stop_watching(self) -> None:
        if self.watching:
            self.watching = False
            self.reads.__exit__(None, None, None)

    # -- the backward -----------------------------------------------------------------------------------------

    def _grad_landed(self, param: nn.Parameter) -> None:
        self.landed.add(id(param))
        self.block_backward()

    def block_backward(self) -> None:
        """A block's backward begins, or a root parameter's gradient has landed: park the root units none of whose
        parameters the modules that ran after the blocks still need."""
        if not (self.enabled and self.parked_in_forward and not self.between):
            return
        for unit in self.roots:
            if unit.parked or unit.state is not UnitState.BACKWARD or unit.refs != unit.backward_refs:
                continue
            needed = [p for owner in self.tail for p in self.params_of[owner] if self.unit_of.get(id(p)) is unit]
            if all(id(p) in self.landed or self.head_done(p) for p in needed):
                self._move(self.park, unit)

    def close(self) -> None:
        self._stop_watching()
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()


class _UnforeseenReads(TorchFunctionMode):
    """While a forward has the root parked: any torch call given a root parameter reports it (RootUses decides)."""

    def __init__(self, uses: RootUses):
        super().__init__()
        self.uses = uses

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.uses.enabled and not self.uses.moving:
            for value in tree_flatten((args, kwargs))[0]:
                if isinstance(value, nn.Parameter) and id(value) in self.uses.unit_of:
                    self.uses.unforeseen_read(value)
                    break
        return func(*args, **kwargs)
