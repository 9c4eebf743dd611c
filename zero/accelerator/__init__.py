"""DeepSpeed's `deepspeed.accelerator`: `get_accelerator()` answers what scripts ask of the device they run on
(its name, count, memory, seeds, the collective backend) for CUDA, or for the CPU where there is none, with
DeepSpeed's method names, backed by torch."""
from __future__ import annotations

import os
from typing import Any

import torch


class Accelerator:
    """The device this process computes on: "cuda" where torch sees a GPU, else "cpu"."""

    def __init__(self) -> None:
        self._name = "cuda" if torch.cuda.is_available() else "cpu"

    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None or self._name == "cpu" else f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._name == "cuda" else 0

    def current_device_name(self) -> str:
        return self.device_name(self.current_device()) if self._name == "cuda" else "cpu"

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._name == "cuda" else 1

    def set_device(self, device_index: int) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        if self._name == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._name == "cuda":
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._name == "cuda" else True

    def is_fp16_supported(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "nccl" if self._name == "cuda" else "gloo"

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._name == "cuda" else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._name == "cuda" else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            return torch.cuda.mem_get_info(device_index)[0]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._name == "cuda" else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._name == "cuda" else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"


_accelerator: list[Accelerator] = []


def get_accelerator() -> Any:
    """The process's accelerator, made at the first call (whether CUDA is present does not change after)."""
    if not _accelerator:
        _accelerator.append(Accelerator())
    return _accelerator[0]


__all__ = ["Accelerator", "get_accelerator"]
