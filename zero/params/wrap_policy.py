"""Wrap policy: which modules become units. By default the model's repeated blocks (the elements of its
largest nn.ModuleList of same-class modules, e.g. transformer layers); every parameter not inside a block
goes to one root unit. A parameter shared by several modules (tied embeddings) belongs to the block that
holds it when only one block does, else to the root unit. Frozen parameters (requires_grad False: an adapter's
base) follow the same rules, listed apart: they make units of their own beside the block's trained ones, one per
submodule holding nothing else (`frozen_parts`)."""
from __future__ import annotations

from typing import Callable

from torch import nn

from ..integrations.unsupported import UnsupportedFeatureError
from .holders import holders

Policy = Callable[[str, nn.Module], bool]


def repeated_blocks(model: nn.Module) -> set[type[nn.Module]]:
    """Classes of the elements of the model's largest ModuleList whose elements all share one class."""
    best: tuple[int, type | None] = (0, None)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > best[0]:
            classes = {type(m) for m in module}
            if len(classes) == 1:
                best = (len(module), classes.pop())
    return {best[1]} if best[1] is not None else set()


def by_class(classes: set[type[nn.Module]]) -> Policy:
    return lambda name, module: isinstance(module, tuple(classes))


Named = list[tuple[str, nn.Parameter]]


def split_units(model: nn.Module, policy: Policy | None = None) -> list[tuple[str, nn.Module, Named, Named]]:
    """(unit name, the module whose forward the unit follows, its trained parameters, its frozen floating-point
    ones) in module order; the root unit (named '' and following the whole model) comes first. Frozen parameters
    that are not floating point (a quantized base's integer weights) are in none: they stay as they are."""
    policy = policy or by_class(repeated_blocks(model))
    blocks: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if name and policy(name, module) and not any(name.startswith(b + ".") for b, _ in blocks):
            blocks.append((name, module))
    holders: dict[int, int] = {}
    for _, module in blocks:
        for p in module.parameters():
            holders[id(p)] = holders.get(id(p), 0) + 1
    seen: set[int] = set()
    units = []
    for name, module in blocks:
        trained, frozen = [], []
        for pname, p in module.named_parameters(prefix=name):
            # One held by several blocks is used while the block owning it is released: the root unit,
            # gathered for the whole forward and backward, takes it.
            if id(p) not in seen and p.is_floating_point() and holders[id(p)] == 1:
                seen.add(id(p))
                (trained if p.requires_grad else frozen).append((pname, p))
        units.append((name, module, trained, frozen))
    rest = [(n, p) for n, p in model.named_parameters() if id(p) not in seen and p.is_floating_point()]
    root = ("", model, [(n, p) for n, p in rest if p.requires_grad], [(n, p) for n, p in rest if not p.requires_grad])
    return [root] + [u for u in units if u[2] or u[3]]


def frozen_parts(name: str, module: nn.Module, frozen: Named) -> list[tuple[str, nn.Module, Named]]:
    """A unit's frozen parameters, cut by the submodule that holds them (unit name, the module it follows, its
    parameters): a base's weights are gathered where each of its layers runs, as DeepSpeed fetches them, so the
    next layer's shard is read while this one computes (in the backward they stay until the block's ends).
    A submodule qualifies where it holds nothing but these parameters (no trained one beside them, no other
    unit's, none shared with another module: a tied weight is used where both run); the rest stay in one unit
    of `module`, named `<name>#frozen`."""
    ours = {id(p) for _, p in frozen}
    owners = holders(module, [p for _, p in frozen])
    by_owner: dict[int, list[tuple[str, nn.Parameter]]] = {}
    rest = []
    for pname, p in frozen:
        held = owners.get(id(p), [])
        owner = held[0][0] if len(held) == 1 else None
        if owner is None or owner is module or any(id(q) not in ours for q in owner.parameters()):
            rest.append((pname, p))
        else:
            by_owner.setdefault(id(owner), []).append((pname, p))
    paths = {id(m): n for n, m in module.named_modules(prefix=name)}
    parts = [(f"{name}#frozen", module, rest)] if rest else []
    for sub in module.modules():  # in module order: the order their forwards most likely run
        if id(sub) in by_owner:
            parts.append((f"{paths[id(sub)]}#frozen", sub, by_owner[id(sub)]))
    return parts


def check_trainable(recorded: list[tuple[str, nn.Parameter, bool]]) -> None:
    """No parameter's requires_grad changed since the units were made from them (name, parameter, requires_grad):
    a parameter frozen since would still be stepped (its moments and weight decay move it), one unfrozen never."""
    for name, param, trained in recorded:
        if param.requires_grad != trained:
            raise UnsupportedFeatureError(f"changing requires_grad of {name!r} after initialize (to "
                                          f"{param.requires_grad})", "set requires_grad before zero.initialize "
                                          "(a new engine for another trainable set)")
