"""DeepSpeed's `deepspeed.compression.helper`: a submodule found or replaced by its dotted name."""
from __future__ import annotations

from torch import nn


def recursive_getattr(model: nn.Module, module_name: str) -> nn.Module:
    """`model`'s submodule at `module_name` ("layers.0.attn.q_proj")."""
    output = model
    for name in module_name.split("."):
        output = getattr(output, name)
    return output


def recursive_setattr(model: nn.Module, module_name: str, module: nn.Module) -> None:
    """Put `module` at `module_name` in `model`, in place of what is there."""
    *parents, last = module_name.split(".")
    setattr(recursive_getattr(model, ".".join(parents)) if parents else model, last, module)
