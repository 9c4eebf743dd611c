"""The `optimizer` section: Adam and AdamW with DeepSpeed's parameters, stepped by zero-tiering's CPU-Adam."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from .errors import UnsupportedKeyError
from .schema import Section, Unsupported, build, join, setting


@dataclass(frozen=True, kw_only=True)
class AdamParams(Section):
    """`optimizer.params` for Adam/AdamW; defaults are DeepSpeed's (FusedAdam / DeepSpeedCPUAdam)."""

    lr: float = setting(1e-3, ge=0)
    """Learning rate (a scheduler, if configured, overrides it step by step)."""

    betas: tuple[float, float] = setting((0.9, 0.999), ge=0, lt=1)
    """Decay rates of the first and second moment estimates."""

    eps: float = setting(1e-8, ge=0)
    """Added to the denominator for numerical stability."""

    weight_decay: float = setting(0.0, ge=0)
    """Weight decay; decoupled (AdamW) or added to the gradient (Adam), see `OptimizerConfig`."""

    bias_correction: bool = True
    """Divide the moment estimates by (1 - beta**step), as torch.optim.AdamW always does."""

    adam_w_mode: bool = True
    """With type "Adam": true (DeepSpeed's default) decouples weight decay, i.e. behaves as AdamW; false is
    classic Adam (L2 added to the gradient). Type "AdamW" is AdamW whatever this says, as in DeepSpeed."""

    torch_adam: bool = False
    """DeepSpeed: run torch.optim.Adam(W) instead of its fused or CPU kernel. The arithmetic is Adam either
    way, so zero-tiering accepts it and always steps with its own CPU-Adam."""

    UNSUPPORTED = {
        "amsgrad": Unsupported("AMSGrad", off=False),
        "max_grad_norm": Unsupported("clipping inside the optimizer", fix="use the top-level gradient_clipping"),
        "fp32_optimizer_states": Unsupported("low-precision Adam moments", off=True),
    }


OPTIMIZERS = ("Adam", "AdamW")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig(Section):
    """DeepSpeed's `optimizer`: which optimizer the engine builds when the user passes none."""

    type: Literal["Adam", "AdamW"] = setting(casefold=True)
    """Adam or AdamW, in any case (DeepSpeed matches names that way). Other DeepSpeed or torch optimizers
    are rejected by name."""

    params: AdamParams = setting(factory=AdamParams)
    """Hyperparameters."""

    UNSUPPORTED = {
        "legacy_fusion": Unsupported("legacy fused optimizer", off=False),
    }

    @property
    def decoupled_weight_decay(self) -> bool:
        """True: AdamW's update (decay applied to the weights); False: classic Adam (decay in the gradient).
        DeepSpeed's rule: type "AdamW", or type "Adam" with adam_w_mode (true by default)."""
        return self.type == "AdamW" or self.params.adam_w_mode

    @classmethod
    def from_json(cls, data: object, path: str, ignored: list[str]) -> OptimizerConfig:
        kind = data.get("type") if isinstance(data, Mapping) else None
        if isinstance(kind, str) and kind.lower() not in {name.lower() for name in OPTIMIZERS}:
            raise UnsupportedKeyError(
                join(path, "type"),
                "an optimizer zero-tiering does not support; supported: 'Adam', 'AdamW' (any case)",
                value=kind,
            )
        return build(cls, data, path, ignored)
