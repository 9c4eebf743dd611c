"""FlatUnit: a group of parameters gathered and released together, flattened into one buffer.

The unit's parameters become views into its flat buffer, so one segment moves and one collective runs
per unit. The flat length is padded to a multiple of world_size x 1024 elements so every rank's shard has
the same size and stays aligned for O_DIRECT I/O in any dtype.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

PAD_ELEMENTS = 1024


class ParamSlot(NamedTuple):
    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size


class FlatUnit:
    def __init__(self, name: str, params: list[tuple[str, nn.Parameter]], world_size: int, rank: int,
                 group: int = 0, frozen: bool = False, within: nn.Module | None = None):
        self.name = name
        self.group = group  # index of the param group (hyperparameters) all its parameters belong to
        self.frozen = frozen
        """Its parameters are not trained (requires_grad False): no gradient, no optimizer state, its shard never
        written after it is first stored."""
        self.within = within
        """Frozen: the module of the unit it was cut from (wrap_policy.frozen_parts), whose backward ends it."""
        self.slots: list[ParamSlot] = []
        offset = 0
        for pname, param in params:
            self.slots.append(ParamSlot(pname, param, offset, param.numel(), param.shape))
            offset += param.numel()
        self.numel = offset
        quantum = world_size * PAD_ELEMENTS
        self.padded_numel = max(quantum, -(-offset // quantum) * quantum)
        self.shard_numel = self.padded_numel // world_size
        self.rank = rank
        self.world_size = world_size

    @property
    def shard_start(self) -> int:
        return self.rank * self.shard_numel

    def rank_range(self, sharded: bool) -> tuple[int, int]:
        """(start, numel) of the flat buffer this rank keeps optimizer state and compute-dtype parameters
        for: its shard when the state is sharded (stages 1-3), the whole padded buffer when not (stage 0)."""
        return (self.shard_start, self.shard_numel) if sharded else (0, self.padded_numel)

    @property
    def extents(self) -> list[tuple[int, int]]:
        """(offset, numel) of each parameter in the flat buffer: what a compact state format tiles by."""
        return [(slot.offset, slot.numel) for slot in self.slots]

    def flatten(self, out: torch.Tensor) -> torch.Tensor:
        """Copy the parameters' current values into `out` (padded_numel elements; the padding zeroed)."""
        for slot in self.slots:
            out[slot.offset : slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))
        out[self.numel :].zero_()
        return out

    def bind(self, flat: torch.Tensor) -> None:
        """Make every parameter a view into `flat` (the full, gathered buffer)."""
        for slot in self.slots:
            slot.param.data = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def unbind(self) -> None:
        """Drop the parameters' storage: empty placeholders of their dtype, on their device."""
        for slot in self.slots:
            slot.param.data = torch.empty(0, dtype=slot.param.dtype, device=slot.param.device)

    def flatten_grads(self, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Copy the parameters' gradients in the flat range [start, start + out.numel()) into `out` (zeros where a
        parameter got none, and in the padding). The gradients stay: `drop_grads` frees them."""
        end = start + out.numel()
        for slot in self.slots:
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if lo >= hi:
                continue
            view = out[lo - start : hi - start]
            grad = slot.param.grad
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad.reshape(-1)[lo - slot.offset : hi - slot.offset])
        if end > self.numel:
            out[max(self.numel, start) - start :].zero_()
        return out

    def drop_grads(self) -> None:
        for slot in self.slots:
            slot.param.grad = None
