"""DeepSpeed's `deepspeed.ops.adam`: `DeepSpeedCPUAdam` is zero-tiering's CPUAdam under DeepSpeed's constructor,
and `FusedAdam` torch's Adam/AdamW under DeepSpeed's, so a script that builds either and hands it to `initialize`
keeps working (the engine takes its param groups and hyperparameters and steps them itself); DeepSpeed's ZenFlow
optimizers raise UnsupportedFeatureError, on import by name too."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..optim.cpu_adam import CPUAdam, check_group
from ..integrations.unsupported import ADAM_INSTEAD, UnsupportedFeatureError, stand_ins_getattr

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

CANNOT_HONOUR = {
    "amsgrad": (False, "Adam without AMSGrad (DeepSpeed's CPU-Adam does not implement it either): drop amsgrad"),
    "bias_correction": (True, "Adam with bias correction, as torch.optim.AdamW: drop bias_correction"),
    "fp32_optimizer_states": (True, "fp32 Adam moments (the host or nvme tier holds them, not the device): "
                                    "drop fp32_optimizer_states"),
}
"""DeepSpeedCPUAdam arguments CPUAdam cannot honour: the only value accepted, and what to do instead."""


class DeepSpeedCPUAdam(CPUAdam):
    """CPUAdam with DeepSpeed's signature and defaults (weight_decay 0; `adamw_mode` False is classic Adam).

    Like DeepSpeed's, it takes the model's params whatever their device or dtype (a model on the GPU, in bf16,
    or built on meta under zero.Init), since `initialize` takes only its param groups and hyperparameters;
    stepping it on its own needs CPU fp32 params, checked at the step.
    """

    def __init__(self, model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True):
        given = {"amsgrad": amsgrad, "bias_correction": bias_correction,
                 "fp32_optimizer_states": fp32_optimizer_states}
        for name, value in given.items():
            accepted, instead = CANNOT_HONOUR[name]
            if value != accepted:
                raise UnsupportedFeatureError(f"DeepSpeedCPUAdam({name}={value!r})", instead)
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         adamw_mode=adamw_mode)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The group's options and hyperparameters are checked now; its params' device and dtype at a step."""
        check_group({**self.defaults, **param_group})
        torch.optim.Optimizer.add_param_group(self, param_group)


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's FusedAdam: AdamW (`adam_w_mode`, its default) or Adam with L2 decay, under DeepSpeed's
    signature. Given to `initialize`, the engine steps its groups (on the device, or on CPU-Adam with
    offload_optimizer); stepped on its own it is torch's Adam, fused where torch has a kernel for the device."""

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True):
        if amsgrad:
            raise UnsupportedFeatureError("FusedAdam(amsgrad=True)", "Adam without AMSGrad (DeepSpeed's FusedAdam "
                                          "refuses it too): drop amsgrad")
        if not bias_correction:
            raise UnsupportedFeatureError("FusedAdam(bias_correction=False)", CANNOT_HONOUR["bias_correction"][1])
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


__getattr__ = stand_ins_getattr(__name__, "deepspeed.ops.adam", {
    name: ADAM_INSTEAD for name in ("ZenFlowCPUAdam", "ZenFlowSelectiveAdamW", "ZenFlowSelectiveAdamW_stage3")
})
