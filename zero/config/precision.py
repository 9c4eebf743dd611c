"""The `fp16` and `bf16` sections: low-precision compute over fp32 master weights, as DeepSpeed describes it."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal

from .errors import ConfigError
from .schema import Section, Unsupported, setting


@dataclass(frozen=True, kw_only=True)
class FP16Config(Section):
    """DeepSpeed's `fp16`: fp16 compute, fp32 master weights, and a loss scale that keeps small gradients
    representable. With dynamic scaling an overflow (inf/nan gradient) skips the step and lowers the scale."""

    enabled: bool = False
    """Train in fp16 (exclusive with bf16)."""

    auto_cast: bool = False
    """Cast floating-point inputs of the forward to fp16 before the model sees them."""

    loss_scale: float = setting(0.0, ge=0)
    """0: dynamic loss scaling. > 0: this fixed scale, never changed."""

    initial_scale_power: int = setting(16, ge=0, le=64)
    """Dynamic scaling starts at 2**initial_scale_power."""

    loss_scale_window: int = setting(1000, ge=1)
    """Dynamic scaling doubles the scale after this many consecutive steps without overflow."""

    hysteresis: int = setting(2, ge=1)
    """Dynamic scaling lowers the scale only after this many overflows (a delay against single spikes)."""

    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every step without overflow, so only consecutive overflows lower
    the scale."""

    min_loss_scale: float = setting(1.0, gt=0)
    """Dynamic scaling never goes below this scale."""

    UNSUPPORTED = {
        "fp16_master_weights_and_grads": Unsupported("fp16 master weights and gradients", off=False),
    }


@dataclass(frozen=True, kw_only=True)
class BF16Config(Section):
    """DeepSpeed's `bf16` (old name `bfloat16`): bf16 compute with fp32 master weights; no loss scaling, as
    bf16 has fp32's exponent range."""

    enabled: bool = False
    """Train in bf16 (exclusive with fp16)."""

    bf16_optimizer_states: bool = False
    """DeepSpeed 0.18's: keep the Adam moments in bf16 (zero_tiering.moments "bf16")."""

    bf16_master_weights_and_grads: bool = False
    """DeepSpeed 0.18's: keep the master weights in bf16, rounded to nearest (zero_tiering.master "bf16");
    gradients are kept as they are without it (in the reduction's dtype, fp32 when accumulated)."""

    UNSUPPORTED = {
        "check_grad_overflow": Unsupported("skipping bf16 steps whose gradients overflow", off=False),
    }
    IGNORED = {
        "immediate_grad_update": "DeepSpeed's choice of when each micro-batch's gradient is added into the "
                                 "fp32 accumulator; zero-tiering adds it once per micro-batch either way",
    }


AUTOCAST_DTYPES = {"bf16": ("torch.bfloat16", "bf16", "bfloat16"), "fp16": ("torch.float16", "fp16", "float16", "half")}
"""torch_autocast.dtype's spellings, as DeepSpeed's DtypeEnum reads them, by the name kept here."""


def _autocast_dtype(value: object) -> object:
    for name, spellings in AUTOCAST_DTYPES.items():
        if value in spellings:
            return name
    if value in ("torch.float32", "fp32", "float32", "float", "torch.int8", "int8"):
        raise ValueError("torch.autocast computes in bfloat16 or float16 only")
    return value


@dataclass(frozen=True, kw_only=True)
class TorchAutocastConfig(Section):
    """DeepSpeed's `torch_autocast`: the engine's forward runs under torch.autocast over parameters kept in their
    own dtype (fp32 unless bf16 or fp16 is enabled), so each op picks its precision (matrix products in `dtype`,
    reductions and norms in fp32). fp16 gets a dynamic loss scale stepped as torch's GradScaler steps it."""

    enabled: bool = False
    """Run the forward under torch.autocast."""

    dtype: Literal["bf16", "fp16"] | None = setting(None, convert=_autocast_dtype)
    """The autocast dtype ("bfloat16", "torch.bfloat16", "bf16"; "float16", "torch.float16", "fp16", "half");
    null: torch's default for the device (float16 on CUDA, bfloat16 on the CPU)."""

    lower_precision_safe_modules: tuple[str, ...] | None = None
    """DeepSpeed's modules (dotted class names) whose gradients it reduces in `dtype`; checked to import, and
    otherwise unused: zero-tiering reduces every gradient in fp32 (or communication_data_type)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in self.lower_precision_safe_modules or ():
            module, _, cls = name.rpartition(".")
            try:
                found = getattr(importlib.import_module(module), cls) if module else None
            except (ImportError, AttributeError):
                found = None
            if not isinstance(found, type):
                raise ConfigError("lower_precision_safe_modules",
                                  f"{name!r} is not an importable class (a dotted name such as "
                                  "'torch.nn.modules.linear.Linear')", value=list(self.lower_precision_safe_modules))
