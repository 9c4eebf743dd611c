"""The state_dict of a model whose units are partitioned: torch puts views of empty storage in the entries of
partitioned parameters; a hook fills them with full values, one unit gathered at a time."""
from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .unit import Unit


def full_values_hook(model: nn.Module, units: list[Unit], gather: Callable[[Unit], None],
                     release: Callable[[Unit], None]):
    """A state_dict hook for `model` filling its partitioned parameters' entries (every name a parameter has)."""
    def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        keys: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            keys.setdefault(id(p), []).append(prefix + name)
        for unit in units:
            gather(unit)
            try:
                for slot in unit.flat.slots:
                    value = slot.param.detach().clone()
                    for key in keys.get(id(slot.param), ()):
                        if key in state_dict:
                            state_dict[key] = value
            finally:
                release(unit)
    return hook
