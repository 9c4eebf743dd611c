"""DeepSpeed's ZeRO-3 leaf modules (`deepspeed.utils.set_z3_leaf_modules` and its siblings): a module marked a leaf
has all its parameters fetched on entry, not submodule by submodule, which DeepSpeed needs for MoE blocks (their
experts run in an order that changes every step) and finely nested modules. The marks are DeepSpeed's
(`module._z3_leaf`), set and read as DeepSpeed's functions do, with their signatures and errors.

Our ZeRO-3 needs no mark for that: it gathers by unit, and a unit is a whole block (an element of the model's largest
ModuleList of same-class modules, usually a decoder layer) or the root unit (what no block holds), gathered before
its module's forward and released after it (zero/params/wrap_policy.py). A leaf inside one block, the usual case
(an MoE block in a decoder layer), is thus gathered whole on entering its block, and prefetch follows a recorded
trace that survives a step that skips an expert. Where the units are finer than the leaf (its experts are the
model's largest ModuleList, or its frozen weights make units per layer under zero_tiering.frozen_units "layer"),
each is gathered where its module runs: a forward that reads such a weight outside that module finds it released,
an error rather than a wrong value.
"""
from __future__ import annotations

from torch import nn


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether `model` is marked a leaf."""
    return getattr(model, "_z3_leaf", False)


def z3_leaf_parameter(model: nn.Parameter) -> bool:
    """Whether the parameter is marked as belonging to a leaf (DeepSpeed's engine marks them; ours does not)."""
    return hasattr(model, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules in `model` marked leaves."""
    return [module for module in model.modules() if z3_leaf_module(module)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    model._z3_leaf = flag


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: list[type | str],
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Mark the modules of these classes (classes, or their names, plain or fully qualified) leaves; the modules
    marked. None found: ValueError, unless `raise_if_not_found` is False."""
    return _mark_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: list[type | str],
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """Unmark the modules of these classes; the modules unmarked."""
    return _mark_classes(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: list[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark (or with `flag` False unmark) the modules named as in `named_modules()`; the modules and the names
    that match none (ValueError if any, unless `raise_if_not_found` is False)."""
    by_name = dict(model.named_modules())
    found, missing = [], []
    for name in module_names:
        if name in by_name:
            by_name[name]._z3_leaf = flag
            found.append(by_name[name])
        else:
            missing.append(name)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules named {missing} found in model {model}")
    return found, missing


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: list[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark (or unmark) the modules whose `named_modules()` name ends with one of the suffixes; the modules, each
    once, and the suffixes that match none."""
    found: dict[int, nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        matched = [module for name, module in model.named_modules() if name.endswith(suffix)]
        for module in matched:
            module._z3_leaf = flag
            found.setdefault(id(module), module)
        if not matched:
            missing.append(suffix)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules matching suffixes {missing} found in model {model}")
    return list(found.values()), missing


def _mark_classes(model: nn.Module, classes: list[type | str], flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    if not all(isinstance(cls, (type, str)) for cls in classes):
        raise TypeError(f"leaf_module_classes must be a list of types or names, got {classes}")
    marked = []

    def mark(module: nn.Module) -> None:
        if any(_is_of(module, cls) for cls in classes):
            module._z3_leaf = flag
            marked.append(module)

    model.apply(mark)  # DeepSpeed's order: children before their parent
    if not marked and raise_if_not_found:
        raise ValueError(f"No modules of type {classes} found in model {model}")
    return marked


def _is_of(module: nn.Module, cls: type | str) -> bool:
    if isinstance(cls, type):
        return isinstance(module, cls)
    own = type(module)
    return cls in (own.__name__, f"{own.__module__}.{own.__qualname__}")
