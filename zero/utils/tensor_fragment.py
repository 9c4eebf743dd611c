"""DeepSpeed's `deepspeed.utils.tensor_fragment` accessors of one parameter's training state, whole, wherever its
shards live: what libraries written for DeepSpeed call to read or set a parameter's fp32 master, gradient or Adam
moments under ZeRO (every rank calls them, as DeepSpeed's). The engine that trains the parameter answers; a parameter no
engine trains gives None, as DeepSpeed's do.
"""
from __future__ import annotations

import torch

from ..params.ds_param import owner_of

OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq")
"""DeepSpeed's optimizer state keys for Adam, which are also the engine's names of those state parts."""


def _engine(param: torch.Tensor):
    owner = owner_of(param)
    return owner if hasattr(owner, "full_state") else None


def _state_part(optim_state_key: str) -> str:
    if optim_state_key not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer state {optim_state_key!r}: Adam's are {', '.join(OPTIMIZER_STATES)}")
    return optim_state_key


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The parameter's fp32 master weights, whole."""
    engine = _engine(param)
    return None if engine is None else engine.full_state(param, "master")


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The parameter's fp32 gradient accumulated since the last step (reduced over ranks, unscaled), whole; None
    between a step and the next backward."""
    engine = _engine(param)
    return None if engine is None else engine.full_state(param, "grad")


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The parameter's Adam moment `optim_state_key` ("exp_avg" or "exp_avg_sq"), whole."""
    engine = _engine(param)
    return None if engine is None else engine.full_state(param, _state_part(optim_state_key))


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the parameter's fp32 master (and its value in the compute dtype) to `value`."""
    _settable(param).set_full_state(param, "master", value)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the gradient the next step applies to the parameter to `value` (unscaled)."""
    _settable(param).set_full_state(param, "grad", value)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the parameter's Adam moment `optim_state_key` ("exp_avg" or "exp_avg_sq") to `value`."""
    _settable(param).set_full_state(param, _state_part(optim_state_key), value)


def _settable(param: torch.Tensor):
    engine = _engine(param)
    if engine is None:
        raise ValueError(f"no zero-tiering engine trains this parameter (shape {tuple(param.shape)}): set it "
                         "before initialize, or pass it to initialize among the trained parameters")
    return engine
