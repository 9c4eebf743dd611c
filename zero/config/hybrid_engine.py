"""The `hybrid_engine` section: DeepSpeed-Chat's RLHF actor switches to DeepSpeed's inference kernels for `generate`
and back for training. zero-tiering generates through the ZeRO-3 units as any forward runs (the training forward's
arithmetic), so the section asks nothing of it beyond a tensor-parallel size of 1."""
from __future__ import annotations

from dataclasses import dataclass

from .schema import Section, Unsupported

KERNEL_TUNING = "DeepSpeed's inference-kernel settings for generation; generation runs through the ZeRO-3 units here"


@dataclass(frozen=True, kw_only=True)
class HybridEngineConfig(Section):
    """DeepSpeed's `hybrid_engine`: accepted; `generate` runs as any forward of the engine's model."""

    enabled: bool = False
    """DeepSpeed: serve the actor's `generate` with inference kernels. Here: the same ZeRO-3 forward either way."""

    UNSUPPORTED = {"inference_tp_size": Unsupported("tensor parallelism in generation", off=1)}
    IGNORED = {name: KERNEL_TUNING for name in (
        "max_out_tokens", "release_inference_cache", "pin_parameters", "tp_gather_partition_size")}
