"""The model's weights in the compute dtype, in one torch.save file (engine.save_16bit_model): what a user who leaves
with the model alone loads with load_state_dict, as DeepSpeed's save_16bit_model writes it. Not a checkpoint: no
optimizer state, nothing to resume from."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..engine import ZeroEngine


def save_16bit_model(engine: ZeroEngine, save_dir: str | os.PathLike, save_filename: str,
                     exclude_frozen_parameters: bool) -> None:
    """Rank 0 writes, through a temporary file renamed into place; every rank calls it (units gathered one by one,
    rank 0 copying each to host memory, where the whole model is then held in 16 bits, as DeepSpeed does)."""
    keep = engine.dp.rank == 0
    module = engine.module
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if p.requires_grad or not exclude_frozen_parameters:
            names.setdefault(id(p), []).append(name)
    state: dict[str, torch.Tensor] = {}
    for unit in engine.units:
        engine.placement.gather(unit)
        try:
            for slot in unit.flat.slots:
                if keep and id(slot.param) in names:
                    value = slot.param.detach().to("cpu", copy=True)
                    state.update((name, value) for name in names[id(slot.param)])
        finally:
            engine.placement.release(unit)
    if keep:
        for name, p in module.named_parameters(remove_duplicate=False):  # those in no unit: frozen
            if name not in state and id(p) in names:
                state[name] = p.detach().cpu()
        for prefix, owner in module.named_modules():
            for name, buffer in owner.named_buffers(recurse=False):
                if name not in owner._non_persistent_buffers_set:
                    state[f"{prefix}.{name}" if prefix else name] = buffer.detach().cpu()
        os.makedirs(save_dir, exist_ok=True)
        path = os.path.join(save_dir, save_filename)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    engine.dp.barrier()
