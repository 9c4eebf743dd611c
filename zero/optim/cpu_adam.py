"""CPUAdam: a torch.optim.Optimizer that steps CPU fp32 params with the fused CPU-Adam arithmetic.

Usable on its own like torch.optim.AdamW (same hyperparameters, same state_dict layout, so state moves both
ways between the two), and by the engine, which adds what a plain optimizer lacks: a per-step gradient scale
(loss-scale unscale times clipping coefficient) and, per fp32 master param, the bf16/fp16 tensor that
receives the updated param in the same pass.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .adam_math import OUT_DTYPES, AdamInputError, AdamThreads, adam_blocks, check_hyperparameters

UNSUPPORTED = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}
"""torch.optim.Adam(W) options that change the arithmetic and that CPUAdam does not implement, with the only
value it accepts (torch's default). Every param group carries them, so a state_dict has torch's layout."""

TORCH_IMPLEMENTATION = {"foreach": None, "fused": None}
"""torch's choice among its own implementations. CPUAdam has one, so its constructor takes only None; a
loaded torch state_dict may carry any value, which is kept (for the way back to torch) and means nothing here."""


class UnsupportedOptionError(ValueError):
    """A torch.optim.Adam(W) option (or value) CPUAdam does not implement: an error, never ignored."""

    def __init__(self, option: str, value: object, accepted: object):
        self.option, self.value = option, value
        super().__init__(f"CPUAdam does not support {option}={value!r} (only {option}={accepted!r})")


class CPUAdam(torch.optim.Optimizer):
    """Adam / AdamW over CPU fp32 params: one fused pass over each param, block by block, on our threads.

    `adamw_mode=True` is torch.optim.AdamW (decoupled weight decay), False is torch.optim.Adam (weight decay
    added to the gradient); the group key is torch's `decoupled_weight_decay`. `threads` is how many threads
    step the params (an AdamThreads, started at the first step and kept; None: torch.get_num_threads()).
    Its threads end when the optimizer is garbage-collected, or at `close()`.
    Other torch options are accepted at their defaults only (see UNSUPPORTED); any other value raises
    UnsupportedOptionError.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        adamw_mode: bool = True,
        *,
        threads: int | None = None,
        **options: Any,
    ):
        accepted = {**UNSUPPORTED, **TORCH_IMPLEMENTATION}
        for option, value in options.items():
            if option not in accepted:
                raise TypeError(f"CPUAdam got an unexpected keyword argument {option!r}")
            _check_option(option, value, accepted[option])
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise AdamInputError(f"threads = {threads!r}: an int >= 1, or None for torch.get_num_threads()")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=adamw_mode, **accepted)
        self.threads = threads
        self._workers: AdamThreads | None = None
        self._outputs: dict[torch.Tensor, torch.Tensor] = {}
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled or deep-copied (torch's __getstate__ keeps only defaults, state and groups): no threads
        yet, no outputs (they belong to the original's owner)."""
        super().__setstate__(state)
        self.__dict__.setdefault("threads", None)
        self.__dict__.setdefault("_workers", None)
        self.__dict__.setdefault("_outputs", {})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        check_group({**self.defaults, **param_group})
        for p in params:
            if p.device.type != "cpu" or p.dtype != torch.float32:
                raise ValueError(f"CPUAdam steps CPU fp32 params; got {p.dtype} on {p.device} "
                                 f"(shape {tuple(p.shape)})")
        super().add_param_group({**param_group, "params": params})

    def close(self) -> None:
        """End the threads now (a later step starts new ones)."""
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict of ours or of torch.optim.Adam(W); groups using options we lack raise."""
        for group in state_dict["param_groups"]:
            check_group({**self.defaults, **group})
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            for p in group["params"]:
                state = self.state.get(p)
                if state and "step" in state:
                    state["step"] = torch.as_tensor(state["step"], dtype=torch.float32, device="cpu").clone()

    def set_output(self, param: torch.Tensor, out: torch.Tensor | None) -> None:
        """Make each step write `param`'s updated value, cast, into `out` (a contiguous CPU bf16/fp16 tensor
        of the same element count, e.g. the host staging buffer the device reads next); None stops it."""
        if not any(param is p for group in self.param_groups for p in group["params"]):
            raise ValueError(f"set_output: the param (shape {tuple(param.shape)}) is not in this optimizer")
        if out is None:
            self._outputs.pop(param, None)
            return
        if out.dtype not in OUT_DTYPES or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(f"set_output: out is {out.dtype} on {out.device} (contiguous: "
                             f"{out.is_contiguous()}); expected a contiguous CPU tensor of one of {OUT_DTYPES}")
        if out.numel() != param.numel():
            raise ValueError(f"set_output: out has {out.numel()} elements, the param {param.numel()}")
        self._outputs[param] = out

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *, grad_scale: float = 1.0) -> float | None:
        """One step of every param that has a gradient; `grad_scale` multiplies the gradients in the same
        pass (when it is not 1 they are left holding the scaled values). Every param's blocks go to the
        threads in one go, so small params cost no hand-off each (see AdamThreads)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._workers is None:
            self._workers = AdamThreads(self.threads)
        blocks, stepped = [], []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(f"CPUAdam does not support sparse gradients (param shape {tuple(p.shape)})")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                out = self._outputs.get(p)
                blocks.extend(adam_blocks(
                    p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                    step=int(state["step"]) + 1, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], decoupled=group["decoupled_weight_decay"],
                    grad_scale=grad_scale, out=out,
                ))
                stepped.append(state["step"])
        self._workers.run(blocks)
        for step in stepped:  # counted once every param's arguments passed their checks
            step.add_(1)
        return loss


def _check_option(option: str, value: object, accepted: object) -> None:
    ok = value is None if accepted is None else value == accepted and isinstance(value, (bool, int))
    if not ok:
        raise UnsupportedOptionError(option, value, accepted)


def check_group(group: dict[str, Any]) -> None:
    """A param group's options and hyperparameters (its params aside): what CPUAdam does not implement raises."""
    for option, accepted in UNSUPPORTED.items():
        _check_option(option, group.get(option, accepted), accepted)
    beta1, beta2 = group["betas"]
    check_hyperparameters(step=1, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                          weight_decay=group["weight_decay"], grad_scale=1.0)
