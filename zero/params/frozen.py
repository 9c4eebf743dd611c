"""A frozen unit's two checks and the signal that ends its backward (DESIGN.md, "frozen").

A frozen unit's parameters get no gradient, so nothing like a trained unit's gradient hooks says when the backward
is done with them. The frozen units cut from one unit's module (wrap_policy.frozen_parts: a block's base, layer by
layer) end together (`FrozenEnds`): the forward passes that module's inputs that need a gradient through an
identity (`_InputsDone`) whose backward runs once all their gradients are computed: every use of the frozen
weights toward those inputs is behind it. The identity sits on the enclosing module's inputs, not on each layer's,
where the summation order of an input's gradients (several layers read one) would change and the bits with it. A
token counts each such call until its backward fires, or until its graph is freed without one (a forward without a
backward, a recomputation discarded), when a finalizer drops it from the count.
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
    """The frozen units cut from one unit's module: their backward ends once that module's inputs have their
    gradients and its trained units theirs."""

    module: nn.Module
    units: list[Unit] = field(default_factory=list)
    inputs_pending: int = 0
    """Forward calls of `module` whose inputs' gradients backward has not computed yet (their graphs alive)."""


def join_ends(table: dict[int, FrozenEnds], unit: Unit, end: Callable[[FrozenEnds], None]) -> None:
    """Add frozen `unit` to its block's FrozenEnds in `table` (by id of the block), made the first time with a
    hook on the block's inputs that calls `end(ends)` once their gradients are computed."""
    ends = table.get(id(unit.block))
    if ends is None:
        ends = table[id(unit.block)] = FrozenEnds(unit.block)
        unit.hooks.append(unit.block.register_forward_pre_hook(
            lambda m, args, kwargs: inputs_done_after(ends, args, kwargs, lambda: end(ends)), with_kwargs=True))
    ends.units.append(unit)


def inputs_done_after(ends: FrozenEnds, args: tuple, kwargs: dict,
                      then: Callable[[], None]) -> tuple[tuple, dict] | None:
    """The module's call arguments with the tensors that need a gradient passed through `_InputsDone` (counted in
    `ends.inputs_pending` until their gradients are computed, when `then()` runs), or None where autograd records
    nothing or no input needs a gradient."""
    if not torch.is_grad_enabled():
        return None
    leaves, spec = tree_flatten((args, kwargs))
    places = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not places:
        return None
    fired = [False]

    def done() -> None:
        _forget_inputs(ends, fired)
        then()

    token = _Token(done)
    ends.inputs_pending += 1
    weakref.finalize(token, _forget_inputs, ends, fired)
    for place, tensor in zip(places, _InputsDone.apply(token, *(leaves[i] for i in places))):
        leaves[place] = tensor
    return tree_unflatten(leaves, spec)


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


class _Token:
    """What an `_InputsDone` node holds: calls `fire` from its backward; its death (the graph freed) ends the count
    through a finalizer."""
    __slots__ = ("fire", "__weakref__")

    def __init__(self, fire: Callable[[], None]):
        self.fire = fire


def _forget_inputs(ends: FrozenEnds, fired: list[bool]) -> None:
    if not fired[0]:
        fired[0] = True
        ends.inputs_pending -= 1


class _InputsDone(torch.autograd.Function):
    """The identity on a frozen unit's module's inputs that need a gradient: its backward runs once all of their
    gradients are computed, after the last use of the unit's weights for them."""

    @staticmethod
    def forward(ctx, token: _Token, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.token = token
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.token.fire()
        return (None, *grads)
