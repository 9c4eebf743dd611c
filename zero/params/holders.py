"""Which submodules hold a parameter directly: a tied weight has two (an embedding and the head); the root unit's
parameters are used where their holders run (root_uses.py)."""
from __future__ import annotations

from torch import nn


def holders(module: nn.Module, params: list[nn.Parameter]) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(p) -> (submodule of `module`, its name for p) for each of `params` that submodules hold."""
    wanted = {id(p) for p in params}
    found: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None and id(p) in wanted:
                found.setdefault(id(p), []).append((sub, name))
    return found
