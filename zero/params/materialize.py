"""Materializer: real values for a unit's parameters when the model was built on the meta device.

Unit by unit, so a model whose training state exceeds host memory can be initialized: the unit's meta
parameters get host memory (the Parameter objects keep their identity), then each module that owns them
runs its own initialization: a transformers model's `_init_weights(module)`, else `reset_parameters()`.
"""
from __future__ import annotations

import torch
from torch import nn

from .flat_unit import FlatUnit


class Materializer:
    def __init__(self, model: nn.Module):
        self.model = model
        self.init_weights = getattr(model, "_init_weights", None)

    def __call__(self, unit: FlatUnit) -> None:
        ours = {id(slot.param) for slot in unit.slots if slot.param.is_meta}
        if not ours:
            return
        for module in self.model.modules():
            own = list(module.parameters(recurse=False))
            if not any(id(p) in ours for p in own):
                continue
            foreign = [p for p in own if p.is_meta and id(p) not in ours]
            if foreign:
                raise ValueError(f"{type(module).__name__} holds meta parameters of several units; give them "
                                 "real values before zero.initialize")
            for p in own:
                if p.is_meta:
                    torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device="cpu"), p.requires_grad))
            self._initialize(module)

    def _initialize(self, module: nn.Module) -> None:
        with torch.no_grad():
            if self.init_weights is not None:
                self.init_weights(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
            else:
                raise ValueError(f"{type(module).__name__} was built on meta and has no reset_parameters(): "
                                 "zero-tiering cannot initialize its parameters")

    def buffers(self) -> None:
        """Floating meta buffers of modules without parameters (a rotary embedding's `inv_freq`) get their
        values from the same initialization; one it leaves unset (NaN) is an error naming it."""
        if self.init_weights is None:
            return
        for module in self.model.modules():
            names = [n for n, b in module.named_buffers(recurse=False) if b.is_meta and b.is_floating_point()]
            if not names or next(module.parameters(recurse=False), None) is not None:
                continue
            for n in names:
                module._buffers[n] = torch.full_like(module._buffers[n], float("nan"), device="cpu")
            self._initialize(module)
            for n in names:
                if module._buffers[n].isnan().any():
                    raise ValueError(f"buffer {n!r} of {type(module).__name__} was built on meta and its "
                                     "model's _init_weights does not set it: give it real values")
