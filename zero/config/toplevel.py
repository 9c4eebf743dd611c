"""`Config`: a whole ds_config.json, typed, validated and with every "auto" resolved (see loader.py)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from tiering.aio_config import AioConfig

from ..optim.state_format import StateFormat
from .activation_checkpointing import ActivationCheckpointingConfig
from .aio import AioSection
from .checkpoint import CheckpointConfig
from .errors import ConfigError
from .hybrid_engine import HybridEngineConfig
from .optimizer import OptimizerConfig
from .precision import BF16Config, FP16Config, TorchAutocastConfig
from .scheduler import SchedulerConfig
from .schema import DISABLED, Section, Unsupported, setting
from .tiering_section import ZeroTieringSection
from .zero_optimization import ZeroOptimizationConfig


def _fp32_accumulation(value: object) -> bool:
    return value is None or (isinstance(value, Mapping) and value.get("grad_accum_dtype") in (None, "fp32"))


def _data_efficiency_off(value: object) -> bool:
    """Off as DeepSpeed's engine reads it: nothing to do unless random-LTD or curriculum learning is on (each
    within its enabled parent section); `enabled` alone changes nothing."""
    if value is None or (isinstance(value, Mapping) and value.get("enabled", False) is False):
        return True
    if not isinstance(value, Mapping):
        return False

    def on(section: str, feature: str) -> bool:
        parent = value.get(section) or {}
        return bool(parent.get("enabled", False) and (parent.get(feature) or {}).get("enabled", False))

    return not on("data_routing", "random_ltd") and not on("data_sampling", "curriculum_learning")


MONITORING = "logging or monitoring output only"

DEEPSPEED_STATE_KEYS = {"moments": "bf16_optimizer_states", "master": "bf16_master_weights_and_grads"}
"""DeepSpeed's bf16 keys for the optimizer state parts (zero_tiering.moments / .master), each asking for bf16."""


@dataclass(frozen=True, kw_only=True)
class Config(Section):
    """A DeepSpeed config as zero-tiering runs it. Built by `load_config`, which derives the batch sizes and
    fills "auto"; the three batch sizes here are always consistent for the world size it was given."""

    train_batch_size: int = setting(ge=1)
    """Samples per optimizer step over all ranks: micro batch * accumulation steps * world size."""

    train_micro_batch_size_per_gpu: int = setting(ge=1)
    """Samples per forward/backward on one rank."""

    gradient_accumulation_steps: int = setting(ge=1)
    """Micro-batches per optimizer step; `engine.step()` runs the optimizer on every this-many calls."""

    gradient_clipping: float = setting(1.0, ge=0)
    """Clip gradients to this global L2 norm before the step; 0: no clipping. 1.0 where a config omits it, as
    DeepSpeed 0.19.3 and later (earlier versions did not clip)."""

    fp16: FP16Config = setting(factory=FP16Config)
    """fp16 mixed precision."""

    bf16: BF16Config = setting(factory=BF16Config, aliases=("bfloat16",))
    """bf16 mixed precision (DeepSpeed's old key `bfloat16` is accepted)."""

    hybrid_engine: HybridEngineConfig = setting(factory=HybridEngineConfig)
    """DeepSpeed-Chat's generation switch; generation runs through the ZeRO-3 units either way."""

    torch_autocast: TorchAutocastConfig = setting(factory=TorchAutocastConfig)
    """torch.autocast around the engine's forward."""

    optimizer: OptimizerConfig | None = None
    """The optimizer the engine builds; null: the user passes one."""

    scheduler: SchedulerConfig | None = None
    """The learning-rate schedule the engine builds; null: none, or the user passes one."""

    zero_optimization: ZeroOptimizationConfig = setting(factory=ZeroOptimizationConfig)
    """ZeRO stage and tiers."""

    aio: AioSection = setting(factory=AioSection)
    """NVMe I/O settings (see `to_aio_config`)."""

    checkpoint: CheckpointConfig = setting(factory=CheckpointConfig)
    """Checkpoint options."""

    activation_checkpointing: ActivationCheckpointingConfig = setting(factory=ActivationCheckpointingConfig)
    """Where the model's activation checkpoints rest between forward and backward."""

    zero_tiering: ZeroTieringSection = setting(factory=ZeroTieringSection)
    """zero-tiering's own settings: budgets, I/O engine, checksums, trace."""

    dataloader_drop_last: bool = False
    """The loader `initialize` builds from `training_data` drops the last micro-batch when it is short."""

    prescale_gradients: bool = False
    """Divide gradients by world_size before the reduction rather than after it."""

    gradient_predivide_factor: float = setting(1.0, gt=0)
    """Without prescale_gradients: divide by this before the reduction and by world_size / this after it
    (a larger factor keeps fp16 sums from overflowing)."""

    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    """Data type of gradient reductions; null: the training precision."""

    zero_allow_untested_optimizer: bool = False
    """DeepSpeed's permission to use a user-supplied optimizer under ZeRO."""

    zero_force_ds_cpu_optimizer: bool = True
    """DeepSpeed's demand that optimizer offload run its own CPU optimizer (for us: CPU-Adam)."""

    ignored: tuple[str, ...] = setting((), in_json=False)
    """The key paths the file carried that zero-tiering accepts and ignores (see IGNORED), for a log line."""

    UNSUPPORTED = {
        "amp": Unsupported("NVIDIA Apex AMP; use fp16 or bf16", off=DISABLED),
        "data_types": Unsupported("gradient accumulation in low precision", off=_fp32_accumulation,
                                  fix='remove it or set "grad_accum_dtype": "fp32"'),
        "compression_training": Unsupported("DeepSpeed Compression"),
        "pipeline": Unsupported("pipeline parallelism"),
        "sparse_attention": Unsupported("DeepSpeed sparse attention"),
        "tensor_parallel": Unsupported("tensor parallelism"),
        "weight_quantization": Unsupported("weight quantization"),
        "sequence_parallel_size": Unsupported("sequence parallelism", off=1),
        "gradient_allreduce_op": Unsupported("gradients summed over ranks instead of averaged", off="mean"),
        "use_data_before_expert_parallelism": Unsupported("expert-parallel process groups (MoE)", off=False),
        "fp32_allreduce": Unsupported("fp32 all-reduce of low-precision gradients", off=False),
        "sparse_gradients": Unsupported("sparse gradients", off=False),
        "disable_allgather": Unsupported("broadcast instead of all-gather", off=False),
        "data_efficiency": Unsupported("DeepSpeed Data Efficiency: random-LTD, curriculum learning",
                                       off=_data_efficiency_off, fix='remove it, set "enabled": false, or leave '
                                       "random_ltd and curriculum_learning off"),
        **{name: Unsupported(what, off=DISABLED) for name, what in (
            ("curriculum_learning", "curriculum learning"),
            ("elasticity", "elastic training"),
            ("autotuning", "the autotuner"),
            ("quantize_training", "quantization-aware training"),
            ("progressive_layer_drop", "progressive layer drop"),
            ("eigenvalue", "eigenvalue computation"),
            ("nebula", "Nebula checkpointing"),
        )},
    }
    IGNORED = {
        "seq_parallel_communication_data_type": "sequence parallelism's dtype; there is no sequence parallelism here",
        **{name: MONITORING for name in (
            "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "flops_profiler", "timers",
            "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown")},
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError("bf16.enabled", "fp16 and bf16 cannot both be enabled", value=True)
        if self.activation_checkpointing.cpu_checkpointing and self.zero_tiering.activation_offload not in (None, "cpu"):
            raise ConfigError("zero_tiering.activation_offload",
                              "activation_checkpointing.cpu_checkpointing asks for host memory; drop one of the two",
                              value=self.zero_tiering.activation_offload)
        self._check_state_format()
        autocast = self.torch_autocast
        trained = "bf16" if self.bf16.enabled else "fp16" if self.fp16.enabled else None
        if autocast.enabled and trained is not None and autocast.dtype not in (None, trained):
            raise ConfigError("torch_autocast.dtype", f"{trained}.enabled casts the model to {trained}: autocast in "
                                                      "another dtype would cast it again; drop one of the two",
                              value=autocast.dtype)

    @property
    def state_format(self) -> StateFormat:
        """How the optimizer state is stored: zero_tiering.moments / .master, else DeepSpeed's bf16 keys."""
        zt, bf16 = self.zero_tiering, self.bf16
        moments = zt.moments or ("bf16" if bf16.bf16_optimizer_states else "fp32")
        master = zt.master or ("bf16" if bf16.bf16_master_weights_and_grads else "fp32")
        return StateFormat(moments, master)

    def _check_state_format(self) -> None:
        zt, bf16 = self.zero_tiering, self.bf16
        for part, theirs in DEEPSPEED_STATE_KEYS.items():
            if getattr(bf16, theirs) and getattr(zt, part) not in (None, "bf16"):
                raise ConfigError(f"zero_tiering.{part}", f"bf16.{theirs} asks for 'bf16': drop one of the two",
                                  value=getattr(zt, part))
        fmt = self.state_format
        if fmt.master != "fp32" and not self.bf16.enabled:
            key, value = self._written("master")
            raise ConfigError(key, f"a {fmt.master} master is the bf16 parameter's value: it needs bf16 compute "
                                   "(bf16.enabled); this config computes in "
                                   f"{'fp16' if self.fp16.enabled else 'fp32'}", value=value)

    def _written(self, part: str) -> tuple[str, object]:
        """The key this config sets state `part` ("moments", "master") with, as the user wrote it, and its value:
        ours (zero_tiering.<part>) where set, else DeepSpeed's bf16 one."""
        ours = getattr(self.zero_tiering, part)
        return (f"zero_tiering.{part}", ours) if ours else (f"bf16.{DEEPSPEED_STATE_KEYS[part]}", True)

    @property
    def activation_offload(self) -> str:
        """Where saved activations rest (zero_tiering.activation_offload, else "cpu" with cpu_checkpointing)."""
        if self.zero_tiering.activation_offload is not None:
            return self.zero_tiering.activation_offload
        return "cpu" if self.activation_checkpointing.cpu_checkpointing else "none"

    def to_aio_config(self) -> AioConfig:
        """tiering's AioConfig: the `aio` section's settings with zero_tiering.engine."""
        return self.aio.to_aio_config(self.zero_tiering.engine)
