"""DeepSpeed's `engine.save_16bit_model`: a live engine's weights in the compute dtype, one torch.save file that plain
PyTorch loads (zero.export writes fp32 safetensors from a checkpoint instead)."""
from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from typing import Any

import torch

from .format import CheckpointError
from .ranks import agree


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
    error = None
    if keep:
        try:
            write(engine, state, names, save_dir, save_filename)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it before raising
            error = exc
    agree(engine.dp, error, f"save_16bit_model to {os.fspath(save_dir)!r}")
    return True


def write(engine: Any, state: dict[str, torch.Tensor], names: dict[int, list[str]], save_dir: str | os.PathLike,
          save_filename: str) -> None:
    """Rank 0: add what no unit holds and write the file through a temporary one; a failed write (a full disk:
    torch reports only a position) removes the temporary file and says where and how much room there was."""
    for name, p in engine.module.named_parameters(remove_duplicate=False):  # those in no unit: frozen
        if name not in state and id(p) in names:
            state[name] = p.detach().cpu()
    for prefix, owner in engine.module.named_modules():
        for name, buffer in owner.named_buffers(recurse=False):
            if name not in owner._non_persistent_buffers_set:
                state[f"{prefix}.{name}" if prefix else name] = buffer.detach().cpu()
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, save_filename)
    try:
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    except Exception as exc:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        free = shutil.disk_usage(save_dir).free
        raise CheckpointError(f"writing the 16-bit weights to {path!r} failed with {free} bytes free on its "
                              f"filesystem ({type(exc).__name__}: {exc}); {path!r} is as it was") from exc
