"""DeepSpeed's `deepspeed.checkpointing` (the Megatron-style activation checkpointing API): `checkpoint(function,
*args)` recomputes `function` in the backward, keeping only its inputs, which the engine's activation offload
(the config's activation_checkpointing / zero_tiering.activation_offload) moves off the device like any
torch.utils.checkpoint region's. Settings come from the config file the engine reads, not from `configure`."""
from __future__ import annotations

from typing import Any

from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from .integrations.unsupported import UnsupportedFeatureError, stand_ins_getattr

CONFIG_INSTEAD = ('the config\'s "activation_checkpointing" section (cpu_checkpointing, '
                  "synchronize_checkpoint_boundary) or zero_tiering.activation_offload, which the engine reads")
MODEL_PARALLEL_INSTEAD = "data parallelism under ZeRO-3 (zero-tiering has no model parallelism)"


def checkpoint(function, *args: Any) -> Any:
    """`function(*args)` run without keeping what it saves for the backward, recomputed there instead
    (torch.utils.checkpoint, non-reentrant: inputs that need no gradient and keyword-free calls both work)."""
    return _torch_checkpoint(function, *args, use_reentrant=False)


def configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """DeepSpeed's set-up call. A config file is accepted (the engine reads the same file); a model-parallel unit
    or a switch turned on here raises UnsupportedFeatureError: nothing here would read it."""
    if mpu_ is not None:
        raise UnsupportedFeatureError("deepspeed.checkpointing.configure(mpu_=...): model-parallel checkpoints",
                                      MODEL_PARALLEL_INSTEAD)
    asked = {name: value for name, value in (
        ("partition_activations", partition_activations), ("contiguous_checkpointing", contiguous_checkpointing),
        ("checkpoint_in_cpu", checkpoint_in_cpu), ("synchronize", synchronize), ("profile", profile))
        if value}
    if asked or num_checkpoints is not None:
        raise UnsupportedFeatureError(
            "deepspeed.checkpointing.configure(" + ", ".join(f"{k}={v!r}" for k, v in asked.items())
            + (f"{', ' if asked else ''}num_checkpoints={num_checkpoints!r}" if num_checkpoints is not None else "")
            + ")", CONFIG_INSTEAD)


def is_configured() -> bool:
    """Always: the settings are the config file's, which the engine reads."""
    return True


__getattr__ = stand_ins_getattr("zero.checkpointing", "deepspeed.checkpointing", {
    "model_parallel_cuda_manual_seed": MODEL_PARALLEL_INSTEAD,
    "get_cuda_rng_tracker": MODEL_PARALLEL_INSTEAD,
    "CheckpointFunction": "zero.checkpointing.checkpoint(function, *args)",
})
