"""A live engine's consolidated weights as one `model.safetensors`, streamed unit by unit.

The file `python -m zero.export` writes from a checkpoint, written instead from the engine in memory: the
header from the units' layout first, then each unit gathered (all-gathered across ranks under stage 3),
written and released, then the tensors no unit holds (frozen parameters, persistent buffers). Peak memory is
one gathered unit, never the model. A tensor the model reaches under several names (tied embeddings) is
written once, under its first name; the other names are in the header's metadata (`zero_tiering_aliases`),
as in the export, and `from_pretrained` re-ties them. Parameters are written in the compute dtype (fp32
training: the fp32 weights themselves; the export gives the fp32 masters of a bf16/fp16 run).
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from ..checkpoint.format import AtomicFile
from ..checkpoint.layout import aliases, extras
from ..checkpoint.st_format import ALIASES_KEY, SAFETENSORS, header_bytes

if TYPE_CHECKING:
    from ..engine import ZeroEngine


def save_safetensors(engine: ZeroEngine, out_dir: str | os.PathLike, *, write: bool = True) -> str:
    """Write `out_dir/model.safetensors` from `engine` (atomically: a temporary name, fsynced, renamed). Every
    rank calls it (the gathers are collective); only ranks with `write` write. Returns the file's path."""
    out_dir = os.fspath(out_dir)
    rest = extras(engine)
    plan = [(slot.name, slot.param.dtype, list(slot.shape), None) for unit in engine.units for slot in unit.flat.slots]
    plan += [(name, tensor.dtype, list(tensor.shape), None) for name, tensor, _ in rest]
    path = os.path.join(out_dir, SAFETENSORS)
    if not write:
        for unit in engine.units:  # join the other ranks' gathers
            with engine.gathered_parameters([slot.param for slot in unit.flat.slots]):
                pass
        return path
    os.makedirs(out_dir, exist_ok=True)
    with AtomicFile(out_dir, SAFETENSORS) as f:
        f.write(header_bytes(plan, {"format": "pt", ALIASES_KEY: json.dumps(aliases(engine), sort_keys=True)}))
        for unit in engine.units:  # in plan order: unit by unit, slot by slot
            with engine.gathered_parameters([slot.param for slot in unit.flat.slots]):
                for slot in unit.flat.slots:  # the block lends the parameters a copy the release leaves alone
                    f.write_tensor(slot.param.detach())
        for _, tensor, _ in rest:
            f.write_tensor(tensor.detach())
        f.commit()
    return path
