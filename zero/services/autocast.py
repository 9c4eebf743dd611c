"""torch_autocast: the engine's forward under torch.autocast, as DeepSpeed's engine runs it, without autocast's
copies of the parameters outliving their use.

Autocast casts each parameter an op reads (a Linear's fp32 weight to bf16), and autograd saves the cast for the
backward: held from the forward to the backward, the casts are a whole copy of the model in the autocast dtype,
outside every budget, where ZeRO-3 keeps only the units in use. Saved, a cast of a trainable parameter is kept as
its recipe (the parameter, the dtype, the view) and made again when the backward unpacks it, which is when the
parameter's unit is gathered for its backward (as for a parameter autograd saves itself): the same bits, a cast
being exact and deterministic. Autocast's cache of casts, which would keep each to the end of the forward, is off
for the same reason. A frozen parameter's cast carries no link back to it (no grad_fn) and is saved as it is.
fp16.auto_cast's cast of the forward's inputs (`cast_floating`) lives here too.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..config.toplevel import Config
from ..optim.loss_scaler import LossScaler

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

GRAD_SCALER = dict(scale=2.0**16, dynamic=True, window=2000, hysteresis=1, min_scale=2.0**-24)
"""torch.amp.GradScaler's defaults as a LossScaler: start at 2^16, halve on an overflow, double after 2000 steps
without one (DeepSpeed steps an fp16 autocast run with a GradScaler)."""

Pack = Callable[[torch.Tensor], object]
Unpack = Callable[[object], torch.Tensor]
Wrap = Callable[[Pack, Unpack], tuple[Pack, Unpack]]


def autocast_dtype(cfg: Config, device: torch.device) -> torch.dtype | None:
    """The dtype the engine's forward autocasts to; None without torch_autocast. Unset: torch's default for the
    device (float16 on CUDA, bfloat16 on the CPU), as torch.autocast(dtype=None) takes it."""
    if not cfg.torch_autocast.enabled:
        return None
    name = cfg.torch_autocast.dtype
    return DTYPES[name] if name is not None else torch.get_autocast_dtype(device.type)


def autocast_loss_scaler(cfg: Config, dtype: torch.dtype | None) -> LossScaler | None:
    """The loss scaler of an fp16 autocast over parameters not in fp16 (fp16.enabled brings its own)."""
    if dtype != torch.float16 or cfg.fp16.enabled:
        return None
    return LossScaler(**GRAD_SCALER)


class _Cast:
    """A saved cast of a parameter, kept as what makes it again."""

    __slots__ = ("param", "dtype", "size", "stride", "offset", "version")

    def __init__(self, param: nn.Parameter, tensor: torch.Tensor):
        self.param, self.dtype = param, tensor.dtype
        self.size, self.stride, self.offset = tensor.size(), tensor.stride(), tensor.storage_offset()
        self.version = param._version

    def make(self) -> torch.Tensor:
        if self.param._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"a parameter of shape {tuple(self.param.shape)} was written after the forward cast it to "
                f"{self.dtype} (its version was {self.version}, now {self.param._version})")
        return self.param.detach().to(self.dtype).as_strided(self.size, self.stride, self.offset)


class Autocast:
    """torch.autocast around the engine's forward in `dtype` on `device`, with the parameter casts autograd saves
    kept as recipes (for `module`'s parameters)."""

    def __init__(self, dtype: torch.dtype, device: torch.device, module: nn.Module):
        self.dtype, self.device = dtype, device
        self._params = {id(p) for p in module.parameters()}

    @contextlib.contextmanager
    def forward(self, saving: Callable[[Wrap], contextlib.AbstractContextManager] | None = None) -> Iterator[None]:
        """Around one forward. `saving`: the activation offload's saved-tensor hooks, given a wrapper that puts
        the casts' recipes before them; None: the recipes' own hooks."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.dtype, cache_enabled=False))
            if torch.is_grad_enabled():
                if saving is not None:
                    stack.enter_context(saving(self.wrap))
                else:
                    stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*self.wrap(_keep, _keep)))
            yield

    def wrap(self, pack: Pack, unpack: Unpack) -> tuple[Pack, Unpack]:
        """`pack` and `unpack` with a parameter's cast kept as its recipe ahead of them."""
        def pack_cast(tensor: torch.Tensor) -> object:
            param = self._cast_of(tensor)
            return _Cast(param, tensor) if param is not None else pack(tensor)

        def unpack_cast(saved: object) -> torch.Tensor:
            return saved.make() if isinstance(saved, _Cast) else unpack(saved)
        return pack_cast, unpack_cast

    def _cast_of(self, tensor: torch.Tensor) -> nn.Parameter | None:
        """The engine's parameter `tensor` is a cast (or a view of a cast) of, if it is one."""
        base = tensor if tensor._base is None else tensor._base
        fn = base.grad_fn
        if fn is None or type(fn).__name__ != "ToCopyBackward0" or len(fn.next_functions) != 1:
            return None
        param = getattr(fn.next_functions[0][0], "variable", None)
        if (not isinstance(param, nn.Parameter) or id(param) not in self._params or base.shape != param.shape
                or base.device != param.device or not base.is_contiguous() or base.storage_offset() != 0):
            return None
        return param


def _keep(value):
    return value


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """`value` with every floating-point tensor in it (through lists, tuples and dicts) cast to `dtype`, as
    DeepSpeed's fp16.auto_cast casts the forward's inputs; other values as they are."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [cast_floating(v, dtype) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
