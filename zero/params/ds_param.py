"""DeepSpeed's attributes on a partitioned parameter, which libraries written for DeepSpeed read (PEFT takes a
partitioned weight's shape from `ds_shape` and counts parameters by `ds_numel`; others test `ds_status`), and the
owner a parameter's full values are asked of: zero.Init's staging before `initialize`, the engine after.

DeepSpeed keeps these on the tensor itself, so that is where its readers look; ours are a mirror of the unit's
record (Unit.to sets `ds_status` at each transition), never read by zero-tiering to decide anything but the owner.
"""
from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

import torch

OWNER = "_zero_owner"
"""The attribute naming the object that gathers the parameter (`gathered`) and reads its state."""


class ZeroParamStatus(Enum):
    """DeepSpeed's `deepspeed.runtime.zero.partition_parameters.ZeroParamStatus`, same names and values."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


def mark(param: torch.nn.Parameter, ds_id: int, shape: torch.Size, owner: object,
         status: ZeroParamStatus = ZeroParamStatus.NOT_AVAILABLE, world_size: int = 1) -> None:
    """Give a partitioned `param` DeepSpeed's attributes; a `ds_id` it already has (from zero.Init) stays.

    `ds_tensor` is this rank's partition as DeepSpeed shows one swapped out to nvme: a 0-element tensor whose
    `ds_numel` says its size (1/world_size of the parameter), which is what scripts read of it (counting the
    parameters they train); the values are asked of the owner (GatheredParameters, zero.utils)."""
    if not hasattr(param, "ds_id"):
        param.ds_id = ds_id
    param.ds_shape = torch.Size(shape)
    param.ds_numel = torch.Size(shape).numel()
    param.ds_status = status
    partition = torch.empty(0, dtype=param.dtype, device=param.device)
    partition.ds_numel = -(-param.ds_numel // world_size)
    param.ds_tensor = partition
    setattr(param, OWNER, owner)


def set_owner(param: torch.nn.Parameter, owner: object) -> None:
    """Make `owner` the one a resident parameter's (stages 0-2) full values and state are asked of."""
    setattr(param, OWNER, owner)


def set_status(params: Iterable[torch.nn.Parameter], status: ZeroParamStatus) -> None:
    for p in params:
        p.ds_status = status


def owner_of(param: torch.Tensor) -> object | None:
    return getattr(param, OWNER, None)
