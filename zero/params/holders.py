"""Which submodules hold a parameter directly: a tied weight has two (an embedding and the head); the root unit's
parameters are used where their holders run (root_uses.py), a parameter container's by the module holding it."""
from __future__ import annotations

from torch import nn

CONTAINERS = (nn.ParameterDict, nn.ParameterList)
"""Modules that hold parameters for another's forward to read (never called themselves: PEFT's embedding adapters)."""


def holders(module: nn.Module, params: list[nn.Parameter]) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(p) -> (submodule of `module`, its name for p) for each of `params` that submodules hold."""
    wanted = {id(p) for p in params}
    found: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None and id(p) in wanted:
                found.setdefault(id(p), []).append((sub, name))
    return found


def readers(module: nn.Module, params: list[nn.Parameter]) -> dict[int, list[nn.Module]]:
    """id(p) -> the submodules of `module` whose forward reads p where it is held: its holders, a parameter container
    replaced by the module holding it."""
    parent = {id(child): sub for sub in module.modules() for child in sub.children()}
    found: dict[int, list[nn.Module]] = {}
    for pid, held in holders(module, params).items():
        for sub, _ in held:
            while isinstance(sub, CONTAINERS) and id(sub) in parent:
                sub = parent[id(sub)]
            if not any(sub is seen for seen in found.setdefault(pid, [])):
                found[pid].append(sub)
    return found
