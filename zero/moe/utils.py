"""DeepSpeed's `deepspeed.moe.utils`, for the scripts that call its helpers whether or not their model has MoE
layers: with no expert parameter (none can exist here: `MoE` is not implemented) the parameter groups come back as
DeepSpeed returns them for a dense model; an expert parameter (one marked `allreduce = False`, DeepSpeed's mark)
raises UnsupportedFeatureError."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..integrations.unsupported import MOE_INSTEAD, UnsupportedFeatureError


def is_moe_param(param: torch.Tensor) -> bool:
    """DeepSpeed's test: an expert parameter is one marked `allreduce = False`."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_different_moe_groups_for_optimizer(param_groups: dict | list | tuple,
                                                         max_group_size: int = 178956971) -> list[dict[str, Any]]:
    """The groups as a list (a dict is one group), unchanged: a dense model has no expert parameters to split
    into groups of their own. `max_group_size` is accepted for DeepSpeed's signature (it caps expert groups)."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    _no_experts(p for group in param_groups for p in group["params"])
    return param_groups


def configure_moe_param_groups(model_parameters: list) -> list:
    """DeepSpeed's: groups given as dicts go through `split_params_into_different_moe_groups_for_optimizer`;
    bare parameters of a dense model come back as they are."""
    if model_parameters and isinstance(model_parameters[0], dict):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    _no_experts(model_parameters)
    return model_parameters


def _no_experts(params: Iterable[torch.Tensor]) -> None:
    if any(is_moe_param(p) for p in params):
        raise UnsupportedFeatureError("deepspeed.moe.utils on expert parameters (MoE layers with expert "
                                      "parallelism)", MOE_INSTEAD)
