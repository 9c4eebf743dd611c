"""DeepSpeed's `deepspeed.zero.register_external_parameter` / `unregister_external_parameter`, which Hugging Face
models call under ZeRO-3 (wav2vec2's positional convolution registers its weight-norm parameters with itself).

DeepSpeed gathers a module's own parameters around its forward only, so a parameter another module owns but this
one reads must be registered. Here a unit is gathered around the forward of the block it follows (the root unit, what
no block holds, around the whole forward): a parameter read inside its own block's forward, or a root parameter read
anywhere, is whole with no registration, which is what the calls in transformers register. A parameter of another
block read in this module's forward is not served by registering it: that unit is released there and the forward
fails on its empty parameter (see GatheredParameters' `fwd_module`)."""
from __future__ import annotations

import torch
from torch import nn


def register_external_parameter(module: nn.Module, parameter: torch.nn.Parameter) -> None:
    """Accepted: `parameter` is whole in `module`'s forward where it is in the same block, or in the root unit."""
    _check(module, parameter, "register_external_parameter")


def unregister_external_parameter(module: nn.Module, parameter: torch.nn.Parameter) -> None:
    """Accepted, as its registration was."""
    _check(module, parameter, "unregister_external_parameter")


def _check(module: nn.Module, parameter: torch.nn.Parameter, call: str) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{call}: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"{call}: parameter must be a torch.nn.Parameter, got {type(parameter).__name__}")
