"""The `fp16` and `bf16` sections: low-precision compute over fp32 master weights, as DeepSpeed describes it."""
from __future__ import annotations

from dataclasses import dataclass

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
