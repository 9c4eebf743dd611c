"""fp16 loss scaling with DeepSpeed's semantics (static scale, or dynamic with window and hysteresis).

An overflow (inf or nan in any gradient) skips that optimizer step; the dynamic scaler halves the scale
once hysteresis is used up, and doubles it after `loss_scale_window` steps without overflow.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScaler:
    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    factor: float = 2.0
    _hysteresis_left: int = 0
    _iteration: int = 0
    _last_overflow: int = -1

    def __post_init__(self) -> None:
        self._hysteresis_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        """Called once per optimizer step (taken or skipped)."""
        if not self.dynamic:
            self._iteration += 1
            return
        if overflow:
            if self.hysteresis == 1 or self._hysteresis_left == 1:
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self._hysteresis_left -= 1
            self._last_overflow = self._iteration
        else:
            if self.consecutive_hysteresis:
                self._hysteresis_left = self.hysteresis
            if (self._iteration - self._last_overflow) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self._hysteresis_left = self.hysteresis
                self.scale *= self.factor
        self._iteration += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left, "iteration": self._iteration,
                "last_overflow": self._last_overflow}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self._hysteresis_left = state["hysteresis_left"]
        self._iteration = state["iteration"]
        self._last_overflow = state["last_overflow"]
