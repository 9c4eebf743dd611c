"""Is the compute dtype fast on this device? On most CPUs fp16 matrix products (and bf16 ones on CPUs without
bf16 instructions) run through fallback kernels tens of times slower than fp32: a config written for a GPU then
trains so slowly that it looks hung. Measured, never guessed from CPU flags: the question is what the kernels
this torch will run do here."""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

SLOW = 4.0
"""A dtype whose matrix products take more than this many times fp32's is slow here (fast ones are 0.3-2x)."""
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class SlowComputeWarning(UserWarning):
    """The compute dtype is slow on this device (initialize warns; the main job prints the line itself)."""


@dataclass(frozen=True)
class DtypeSpeed:
    dtype: torch.dtype
    slowdown: float
    """Seconds of this dtype's matrix products over fp32's on the same shapes, measured here."""

    @property
    def slow(self) -> bool:
        return self.slowdown > SLOW

    @property
    def name(self) -> str:
        return NAMES[self.dtype]


def layer_seconds(dtype: torch.dtype, device: torch.device, width: int = 256, tokens: int = 512) -> float:
    """Seconds of a linear layer's three training matmuls (forward, input and weight gradient) in `dtype`:
    the fastest of three, after a warm-up (a fast dtype takes milliseconds, a slow one a fraction of a second)."""
    own = torch.Generator(device).manual_seed(0)  # not the global one: a seeded run draws the same weights after it
    x = torch.randn(tokens, width, dtype=dtype, device=device, generator=own)
    w = torch.randn(width, 4 * width, dtype=dtype, device=device, generator=own)
    g = torch.randn(tokens, 4 * width, dtype=dtype, device=device, generator=own)
    times = []
    for _ in range(4):
        start = time.perf_counter()
        x @ w, g @ w.T, x.T @ g  # noqa: B018
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times[1:])  # the first is the warm-up


@functools.cache
def dtype_speed(dtype: torch.dtype, device: torch.device | str = "cpu") -> DtypeSpeed:
    """Measured once per process and device (a slow dtype costs about a second to measure)."""
    device = torch.device(device)
    if dtype == torch.float32:
        return DtypeSpeed(dtype, 1.0)
    return DtypeSpeed(dtype, layer_seconds(dtype, device) / layer_seconds(torch.float32, device))


def fast_alternative(device: torch.device | str = "cpu") -> torch.dtype:
    """bf16 where it is fast here, else fp32."""
    return torch.bfloat16 if not dtype_speed(torch.bfloat16, device).slow else torch.float32


def slow_dtype_line(speed: DtypeSpeed, device: torch.device | str, instead: torch.dtype, source: str) -> str:
    """The one line a user sees before training in a slow dtype: what was asked, its cost, what to use."""
    return (f"{speed.name} compute (from {source}) is slow on this {torch.device(device).type.upper()}: its matrix "
            f"products take {speed.slowdown:.0f}x fp32's here (measured); use {NAMES[instead]}; {speed.name} is meant "
            "for a GPU")
