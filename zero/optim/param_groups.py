"""ZeroOptimizer: the optimizer object `initialize` hands back. It holds the param groups and their
hyperparameters (what LR schedulers change); the arithmetic runs in the engine's AdamDriver."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..config import Config, ConfigError
from ..integrations.unsupported import UnsupportedFeatureError

ADAM_KINDS = (torch.optim.Adam, torch.optim.AdamW)

UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")
"""Adam options our step does not implement; torch honours each per param group, so every group is checked."""


class ZeroOptimizer(torch.optim.Optimizer):
    """Param groups in torch's shape (`params`, `lr`, `betas`, `eps`, `weight_decay`, plus `decoupled`).

    A torch.optim.Optimizer so that torch's LR schedulers (and the Hugging Face Trainer's, built on the
    optimizer initialize hands them) accept it and steer the engine's lr. The arithmetic runs in the
    engine at the accumulation boundary, so its own step() only says so."""

    def __init__(self, param_groups: list[dict]):
        super().__init__(param_groups, defaults={})  # keeps the same group dicts: a scheduler's edits reach us
        self.step_count = 0
        self.overflow = False
        """Whether the last boundary's step was skipped on an overflow (DeepSpeed's ZeRO optimizers' attribute,
        which DeepSpeed-Chat's PPO trainer reads after each fp16 step)."""

    def step(self, closure=None):
        raise RuntimeError("zero-tiering's optimizer steps inside engine.step(); call that every micro-batch")

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def __repr__(self) -> str:
        return f"ZeroOptimizer({len(self.param_groups)} groups, step {self.step_count})"


def param_groups_from(model: nn.Module, model_parameters: Iterable | None, optimizer, cfg: Config) -> list[dict]:
    """The param groups to train, with hyperparameters from the user's optimizer or else the config.

    `model_parameters` may be parameters or param-group dicts (as deepspeed.initialize takes, e.g. the
    Hugging Face Trainer's weight-decay / no-decay split); a group's own keys override the defaults.
    """
    if optimizer is not None:
        # The optimizer's own group dicts, not copies: an LR scheduler built on it keeps steering the lr.
        defaults, groups = _from_optimizer(optimizer)
        for group in groups:
            group["decoupled"] = group.get("decoupled_weight_decay", defaults["decoupled"])
            group["betas"] = tuple(group["betas"])
        return groups
    else:
        params = cfg.optimizer.params if cfg.optimizer is not None else None
        if params is not None and not params.bias_correction:
            raise ConfigError("optimizer.params.bias_correction", "Adam without bias correction is not supported",
                              value=False)
        defaults = {  # with no optimizer section: DeepSpeed's Adam defaults
            "lr": params.lr if params else 1e-3,
            "betas": tuple(params.betas) if params else (0.9, 0.999),
            "eps": params.eps if params else 1e-8,
            "weight_decay": params.weight_decay if params else 0.0,
            "decoupled": cfg.optimizer.decoupled_weight_decay if cfg.optimizer else True,
        }
        raw = list(model_parameters) if model_parameters is not None else [p for p in model.parameters() if p.requires_grad]
        if raw and not isinstance(raw[0], dict):
            raw = [{"params": raw}]
    groups = []
    for index, group in enumerate(raw):
        _check_flags(group, f"model_parameters[{index}]")
        merged = {**defaults, **{k: v for k, v in group.items() if k != "params"}}
        merged["betas"] = tuple(merged["betas"])
        merged["params"] = [p for p in group["params"] if p.requires_grad]
        for p in merged["params"]:
            if not p.is_floating_point():  # a complex one: the units (real elements) would leave it untrained
                raise UnsupportedFeatureError(f"training a {p.dtype} parameter of shape {tuple(p.shape)}",
                                              "real floating-point parameters (a complex one as two real ones, "
                                              "torch.view_as_real), or requires_grad False")
        groups.append(merged)
    return groups


def _from_optimizer(optimizer) -> tuple[dict, list[dict]]:
    from .cpu_adam import CPUAdam

    if not isinstance(optimizer, (*ADAM_KINDS, CPUAdam)):
        raise ConfigError("optimizer", "zero-tiering steps Adam/AdamW only: pass torch.optim.Adam, "
                          "torch.optim.AdamW or zero.CPUAdam, or set the config's optimizer section",
                          value=type(optimizer).__name__)
    _check_flags(optimizer.defaults, "optimizer")
    for index, group in enumerate(optimizer.param_groups):
        _check_flags(group, f"optimizer.param_groups[{index}]")
    decoupled = optimizer.defaults.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
    defaults = {k: optimizer.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")}
    defaults["decoupled"] = decoupled
    return defaults, optimizer.param_groups


def _check_flags(options: dict, where: str) -> None:
    """Raise ConfigError naming `where` and the first of UNSUPPORTED_FLAGS that `options` turns on."""
    for flag in UNSUPPORTED_FLAGS:
        if options.get(flag):
            raise ConfigError(f"{where}.{flag}", "not supported by zero-tiering's Adam", value=options[flag])
