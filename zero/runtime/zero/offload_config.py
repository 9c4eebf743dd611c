"""DeepSpeed's `deepspeed.runtime.zero.offload_config` enums, as DeepSpeed defines them: the offload devices (the
values of `offload_param.device` and `offload_optimizer.device`) and the kinds of state `engine.offload_states`
moves."""
from __future__ import annotations

from enum import Enum


class OffloadDeviceEnum(str, Enum):
    """Valid offload devices."""
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The engine's buffers that `offload_states` can move."""
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"
