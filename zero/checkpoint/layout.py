"""What a checkpoint records of the model besides the state tensors: the unit layout (checked on load, used by
the export), the tensors no trained unit holds (frozen parameters, persistent buffers), the names tied tensors
share, and a transformers model's config.

Frozen parameters are recorded by name, whole, wherever the engine holds them (in frozen units under stage 3,
as they are below it): a checkpoint is the same for every stage, and `exclude_frozen_parameters` leaves them
out."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from ..engine import ZeroEngine
    from ..params.unit import Unit


def unit_layout(engine: ZeroEngine) -> list[dict]:
    """The trained units (what `state_tensors` numbers), their parameters and where each sits."""
    return [{"name": flat.name, "numel": flat.numel, "padded_numel": flat.padded_numel, "group": flat.group,
             "slots": [{"name": s.name, "offset": s.offset, "numel": s.numel, "shape": list(s.shape)}
                       for s in flat.slots]}
            for flat in (unit.flat for unit in engine.units if not unit.frozen)]


def frozen_units(engine: ZeroEngine) -> list[Unit]:
    return [unit for unit in engine.units if unit.frozen]


def frozen_names(engine: ZeroEngine) -> list[str]:
    """The name each frozen parameter is recorded under (in a frozen unit: its slot's; else its first)."""
    names = [slot.name for unit in frozen_units(engine) for slot in unit.flat.slots]
    return names + [name for name, tensor, is_param in extras(engine) if is_param and not tensor.requires_grad]


def extras(engine: ZeroEngine) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_param) of what no unit holds: parameters not trained (frozen below stage 3, outside
    every param group) and persistent buffers, each once, under its first name."""
    in_units = {id(slot.param) for unit in engine.units for slot in unit.flat.slots}
    out = [(name, p, True) for name, p in engine.module.named_parameters() if id(p) not in in_units]
    seen: set[int] = set()
    for module_name, module in engine.module.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is None or name in module._non_persistent_buffers_set or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            out.append((f"{module_name}.{name}" if module_name else name, buffer, False))
    return out


def aliases(engine: ZeroEngine) -> dict[str, str]:
    """{other name: saved name} for tensors the model reaches under several names (tied weights): the saved
    name of a trained parameter is its unit slot's, of anything else its first name."""
    canonical = {id(slot.param): slot.name for unit in engine.units for slot in unit.flat.slots}
    out = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        first = canonical.setdefault(id(p), name)
        if name != first:
            out[name] = first
    for module_name, module in engine.module.named_modules(remove_duplicate=False):
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            full = f"{module_name}.{name}" if module_name else name
            first = canonical.setdefault(id(buffer), full)
            if full != first:
                out[full] = first
    return out


def model_config(module: nn.Module) -> dict | None:
    """The model's config as a dict, for a transformers model (anything with `config.to_dict()`)."""
    config = getattr(module, "config", None)
    if config is None or not callable(getattr(config, "to_dict", None)):
        return None
    try:
        return json.loads(config.to_json_string(use_diff=False))
    except (AttributeError, TypeError):
        return json.loads(json.dumps(config.to_dict(), default=str))
