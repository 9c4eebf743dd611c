"""A PEFT model's adapters saved from a live engine exactly as PEFT's own `save_pretrained` writes them: every
adapter, active or not (an inactive adapter's parameters are frozen, so they rest in frozen units), and the
embedding and head weights PEFT saves beside them (`save_embedding_layers="auto"`: an embedding LoRA targets, or a
resized vocabulary). Only what PEFT's save reads is gathered, unit by unit: the rest of the base is neither gathered
nor written (ZeroTrainer.save_model writes adapters only, as the Trainer does for a PEFT model).

Which state_dict entries PEFT saves is PEFT's decision (by name, from the adapters' configs and the model's
modules), so it is asked, not copied: `get_peft_model_state_dict` runs on stand-ins (a meta tensor under every
state_dict name, which costs no memory and gathers nothing), and the entries it returns name the parameters to
gather. A PEFT method that computes what it saves from the live model instead (prompt learning runs its prompt
encoder) returns no stand-in and reads the model itself, its forward gathered by the engine's hooks."""
from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from ..engine import ZeroEngine

SAVE_EMBEDDING_LAYERS = "auto"
"""PEFT's default for `save_pretrained(save_embedding_layers=...)`, the one the Trainer's save uses."""


def save_adapters(engine: ZeroEngine, model: nn.Module, output_dir: str | os.PathLike, *, write: bool) -> None:
    """`model.save_pretrained(output_dir)` (PEFT's files: each adapter's adapter_model.safetensors and config) with
    the entries it saves gathered from `engine`. Every rank calls it (the gathers are collective); ranks with
    `write` copy the values and write."""
    state = gathered_values(engine, model, saved_names(model), copy=write)
    if write:
        model.save_pretrained(os.fspath(output_dir), state_dict=state, save_embedding_layers=SAVE_EMBEDDING_LAYERS)


def saved_names(model: nn.Module) -> list[str]:
    """The state_dict names whose values PEFT's save_pretrained writes for some adapter, in state_dict order."""
    from peft.utils import get_peft_model_state_dict

    stand_ins = stand_in_state(model)
    name_of = {id(t): name for name, t in stand_ins.items()}
    picked: set[str] = set()
    with warnings.catch_warnings():  # PEFT's notes on the embedding layers come once, from the save itself
        warnings.simplefilter("ignore")
        for adapter in model.peft_config:
            entries = get_peft_model_state_dict(model, state_dict=stand_ins, adapter_name=adapter,
                                                save_embedding_layers=SAVE_EMBEDDING_LAYERS)
            picked.update(name_of[id(v)] for v in entries.values() if id(v) in name_of)
    return [name for name in stand_ins if name in picked]


def stand_in_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict names (every name, tied ones too; module by module, its parameters then its
    persistent buffers, as `Module.state_dict` has them), each with a meta tensor of its own. Read from the
    modules, not from `state_dict()`, which under stage 3 gathers the whole model."""
    out: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
            out[prefix + name] = torch.empty(_shape(p), dtype=p.dtype, device="meta")
        for name, b in module.named_buffers(recurse=False, remove_duplicate=False):
            if b is not None and name not in module._non_persistent_buffers_set:
                out[prefix + name] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    return out


def gathered_values(engine: ZeroEngine, model: nn.Module, names: list[str], *, copy: bool) -> dict[str, torch.Tensor]:
    """{name: its whole value, on the host} for the parameters and buffers `names` name (a tensor under several
    names is copied once, as PEFT's own state_dict shares it). Units holding one are gathered one at a time, with
    those parameters alone; everything else is read where it is. Every rank calls it; without `copy` it only
    joins the gathers and returns {}."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update((n, b) for n, b in model.named_buffers(remove_duplicate=False) if b is not None)
    wanted = {id(tensors[name]) for name in names}
    values: dict[int, torch.Tensor] = {}
    for unit in engine.units:
        mine = [slot.param for slot in unit.flat.slots if id(slot.param) in wanted]
        if not mine:
            continue
        with engine.gathered_parameters(mine):
            if copy:
                values.update((id(p), p.detach().to("cpu", copy=True)) for p in mine)
    if not copy:
        return {}
    out = {}
    for name in names:
        tensor = tensors[name]
        if id(tensor) not in values:  # in no unit: a parameter left whole (frozen below stage 3), or a buffer
            values[id(tensor)] = tensor.detach().to("cpu", copy=True)
        out[name] = values[id(tensor)]
    return out


def _shape(p: nn.Parameter) -> torch.Size:
    """A parameter's whole shape (a partitioned one holds an empty tensor and keeps it in `ds_shape`)."""
    return torch.Size(getattr(p, "ds_shape", p.shape))
