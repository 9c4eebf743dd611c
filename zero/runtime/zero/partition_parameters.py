"""DeepSpeed's `deepspeed.runtime.zero.partition_parameters`: the names scripts import from it (`zero.zero`'s), and
the tensor-constructor wrapper that transformers swaps in and out around DeepSpeed's zero.Init.

DeepSpeed's zero.Init patches torch's tensor constructors with `zero_wrapper_for_fp_tensor_constructor` so that
tensors made inside it land on the device in the compute dtype; transformers replaces that wrapper for
`torch.arange` (`_orig_torch_arange`) while building rotary tables. Our zero.Init patches nothing (tensors made
inside it are what torch makes), so the swap changes nothing here; the wrapper is DeepSpeed's, for callers of it."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ...accelerator import get_accelerator
from ...zero import GatheredParameters, Init, ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "get_accelerator",
           "zero_wrapper_for_fp_tensor_constructor"]

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype,
                                           target_device: torch.device | None = None) -> Callable:
    """`fn` (a tensor constructor) making its tensor on `target_device` (default: this rank's accelerator) and, if
    floating, in `target_fp_dtype`: DeepSpeed's."""
    def wrapped_fn(*args, **kwargs):
        if kwargs.get("device") is None:
            kwargs["device"] = target_device or torch.device(get_accelerator().current_device_name())
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped_fn
