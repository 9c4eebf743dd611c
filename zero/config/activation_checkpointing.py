"""The `activation_checkpointing` section: DeepSpeed's switches for activation checkpoints, read as DeepSpeed reads
them where zero-tiering implements them. The checkpoints themselves are the model's (torch.utils.checkpoint,
a Hugging Face model's gradient_checkpointing_enable(), zero.checkpointing.checkpoint); this section says where
their saved inputs rest between the forward and the backward (see zero/services/activations.py)."""
from __future__ import annotations

from dataclasses import dataclass

from .schema import Section, Unsupported, setting

MONITORING = "logging or monitoring output only (every activation copy is on the timeline and in the step's report)"


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointingConfig(Section):
    """DeepSpeed's `activation_checkpointing`."""

    cpu_checkpointing: bool = False
    """Offload the checkpointed activations to host memory (zero_tiering.activation_offload "cpu"); nvme is
    zero_tiering.activation_offload "nvme"."""

    number_checkpoints: int | None = setting(None, ge=1)
    """DeepSpeed sizes its contiguous checkpoint buffer with it; each offloaded activation here is a segment of
    its own, so it changes nothing (accepted: users' files carry it)."""

    synchronize_checkpoint_boundary: bool = False
    """Wait for each activation's copy off the device before the forward goes on (DeepSpeed synchronizes the
    device at each checkpoint): slower, for debugging an ordering problem."""

    UNSUPPORTED = {
        "partition_activations": Unsupported(
            "splitting each checkpoint across model-parallel ranks; zero-tiering has no model parallelism",
            off=False, fix="set it to false (cpu_checkpointing or zero_tiering.activation_offload offloads them)"),
        "contiguous_memory_optimization": Unsupported(
            "DeepSpeed's contiguous buffer for partitioned checkpoints (it needs partition_activations there too); "
            "offloaded activations are contiguous segments here already", off=False, fix="set it to false"),
    }
    IGNORED = {"profile": MONITORING}
