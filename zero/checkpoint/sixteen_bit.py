"""DeepSpeed's `engine.save_16bit_model`: a live engine's weights in the compute dtype, one torch.save file that plain
PyTorch loads (zero.export writes fp32 safetensors from a checkpoint instead)."""
from __future__ import annotations

import os
import warnings
from typing import Any

import torch


def save_16bit_model(engine: Any, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """Rank 0 writes the model's state_dict in the compute dtype (torch.save) to `save_dir/save_filename`,
    through a temporary file renamed into place; every rank calls it (stage 3 gathers unit by unit, rank 0
    copying each to host memory, where the whole model is then held in 16 bits, as DeepSpeed does). As
    DeepSpeed, stage 3 saves only with zero_optimization.stage3_gather_16bit_weights_on_model_save true:
    otherwise it warns and returns False."""
    if engine.stage == 3 and not engine.config.zero_optimization.gather_16bit_weights_on_model_save:
        warnings.warn("save_16bit_model did nothing: under stage 3 it needs zero_optimization."
                      "stage3_gather_16bit_weights_on_model_save true (zero.export writes the fp32 weights "
                      "from a checkpoint without it)", stacklevel=3)
        return False
    engine._finish_step()
    keep = engine.dp.rank == 0
    names: dict[int, list[str]] = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
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
        for name, p in engine.module.named_parameters(remove_duplicate=False):  # those in no unit: frozen
            if name not in state and id(p) in names:
                state[name] = p.detach().cpu()
        for prefix, owner in engine.module.named_modules():
            for name, buffer in owner.named_buffers(recurse=False):
                if name not in owner._non_persistent_buffers_set:
                    state[f"{prefix}.{name}" if prefix else name] = buffer.detach().cpu()
        os.makedirs(save_dir, exist_ok=True)
        path = os.path.join(save_dir, save_filename)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    engine.dp.barrier()
    return True
