"""A frozen unit's two checks and the signal that ends its backward (DESIGN.md, "frozen").

A frozen unit's parameters get no gradient, so nothing like a trained unit's gradient hooks says when the backward
is done with them. The frozen units cut from one unit's module (wrap_policy.frozen_parts: a block's base, layer by
layer) end together (`FrozenEnds`): the forward passes that module's inputs that need a gradient through an
identity (`_InputsDone`) whose backward runs once all their gradients are computed: every use of the frozen
weights toward those inputs is behind it. The identity sits on the enclosing module's inputs, not on each layer's,
where the summation order of an input's gradients (several layers read one) would change and the bits with it.

Each such call of the module (`_Call`) holds the units from the moment a backward reaches its outputs (a hook on
them) until its inputs' gradients are computed; a call no backward has reached holds nothing. So a graph kept
alive without a backward (a validation loss kept for logging, a second loss backwarded later) pins no unit through
the backwards of others; when its own backward comes, the units are gathered again by their modules' hooks. A call
leaves when its graph is freed (its `_InputsDone` node holds it; FrozenEnds holds it weakly).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .flat_unit import FlatUnit
from .unit import Unit


@dataclass(eq=False)
class FrozenEnds:
    """The frozen units cut from one unit's module: their backward ends once the calls of that module a backward has
    reached have their inputs' gradients, and its trained units have theirs."""

    module: nn.Module
    units: list[Unit] = field(default_factory=list)
    calls: weakref.WeakSet[_Call] = field(default_factory=weakref.WeakSet)
    """Calls of `module` whose inputs need a gradient, while their graphs are alive."""
    running: list[_Call | None] = field(default_factory=list)
    """Calls of `module` whose forward runs (innermost last; None: one whose inputs need no gradient)."""

    @property
    def inputs_pending(self) -> bool:
        """Whether a backward has reached a call's outputs and not yet computed its inputs' gradients."""
        return any(call.reached for call in self.calls)

    def backward_over(self) -> None:
        """The backward has ended: no call is reached any more (an output no input's gradient depends on may be
        reached after its call's inputs)."""
        for call in self.calls:
            call.reached = False

    def call_begins(self, args: tuple, kwargs: dict, then: Callable[[], None]) -> tuple[tuple, dict] | None:
        """The module's call arguments with the tensors that need a gradient passed through `_InputsDone` (`then()`
        runs once their gradients are computed), or None where autograd records nothing or no input needs one."""
        self.running.append(None)
        if not torch.is_grad_enabled():
            return None
        leaves, spec = tree_flatten((args, kwargs))
        places = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not places:
            return None
        call = self.running[-1] = _Call(then)
        self.calls.add(call)
        for place, tensor in zip(places, _InputsDone.apply(call, *(leaves[i] for i in places))):
            leaves[place] = tensor
        return tree_unflatten(leaves, spec)

    def call_ends(self, output: object) -> None:
        """The call's outputs that need a gradient mark it reached when a backward gets to them."""
        call = self.running.pop()
        if call is not None:
            for value in tree_flatten(output)[0]:
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    value.register_hook(call.reach)


def join_ends(table: dict[int, FrozenEnds], unit: Unit, end: Callable[[FrozenEnds], None]) -> None:
    """Add frozen `unit` to its block's FrozenEnds in `table` (by id of the block), made the first time with hooks
    on the block's calls that call `end(ends)` once a call's inputs have their gradients. (The pre-hook comes first and
    the forward hook is always called: every call's `running` entry is pushed and popped, even one that raises.)"""
    ends = table.get(id(unit.block))
    if ends is None:
        ends = table[id(unit.block)] = FrozenEnds(unit.block)
        unit.hooks.append(unit.block.register_forward_pre_hook(
            lambda m, args, kwargs: ends.call_begins(args, kwargs, lambda: end(ends)), with_kwargs=True, prepend=True))
        unit.hooks.append(unit.block.register_forward_hook(lambda m, args, out: ends.call_ends(out), always_call=True))
    ends.units.append(unit)


def check_frozen(flat: FlatUnit, device: torch.device) -> None:
    """A frozen parameter must come as the model was built (host memory, or meta to be materialized) or on the
    engine's device: one already on another device (a base moved to a GPU the engine does not use) is refused."""
    for slot in flat.slots:
        where = slot.param.device
        if where.type not in ("cpu", "meta") and where != device:
            raise ValueError(f"frozen parameter {slot.name!r} is on {where}, and this engine runs on {device}: "
                             "build or load the base model on the CPU (or under zero.Init) and let initialize "
                             "place it")


def check_unwritten(unit: Unit, release: Callable[[Unit], None]) -> None:
    """A frozen unit's forward wrote none of its parameters in place (the write would be lost at the release);
    where one did, `release(unit)` (the forward's gather) before the error."""
    for slot, version in zip(unit.flat.slots, unit.versions):
        if slot.param._version != version:
            release(unit)
            raise RuntimeError(f"frozen parameter {slot.name!r} was modified in place by its module's forward: a "
                               "frozen parameter's stored bytes are never written back, so the change would be "
                               "lost at its release; make it trainable or change it outside the forward, inside "
                               "zero.GatheredParameters(..., modifier_rank=0)")


class _Call:
    """One call of a FrozenEnds' module whose inputs need a gradient: what its `_InputsDone` node holds. `reached`
    from a backward's arrival at its outputs until `fire` runs (its inputs' gradients computed)."""
    __slots__ = ("then", "reached", "__weakref__")

    def __init__(self, then: Callable[[], None]):
        self.then = then
        self.reached = False

    def reach(self, grad: torch.Tensor) -> None:
        self.reached = True

    def fire(self) -> None:
        self.reached = False
        self.then()


class _InputsDone(torch.autograd.Function):
    """The identity on a frozen unit's module's inputs that need a gradient: its backward runs once all of their
    gradients are computed, after the last use of the unit's weights for them."""

    @staticmethod
    def forward(ctx, call: _Call, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.call = call
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.call.fire()
        return (None, *grads)
