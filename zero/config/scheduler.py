"""The `scheduler` section: DeepSpeed's warmup schedules, with their parameter names and defaults.

The parameters differ per schedule, so each schedule has its own params section and `type` picks it."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from .errors import ConfigError, UnsupportedKeyError
from .schema import Section, build, check_value, join, setting, type_hints


@dataclass(frozen=True, kw_only=True)
class WarmupLRParams(Section):
    """WarmupLR: the learning rate rises from warmup_min_lr to warmup_max_lr over warmup_num_steps, then
    stays at warmup_max_lr."""

    warmup_min_lr: float = setting(0.0, ge=0)
    """Learning rate at step 0."""

    warmup_max_lr: float = setting(1e-3, ge=0)
    """Learning rate at the end of warmup."""

    warmup_num_steps: int = setting(1000, ge=0)
    """Optimizer steps of warmup (DeepSpeed counts at least 2)."""

    warmup_type: Literal["log", "linear"] = "log"
    """Shape of the rise: logarithmic in the step (DeepSpeed's default) or linear."""

    last_batch_iteration: int = setting(-1, ge=-1)
    """Index of the last step taken before this run; -1 starts the schedule from the beginning."""


@dataclass(frozen=True, kw_only=True)
class WarmupDecayLRParams(WarmupLRParams):
    """WarmupDecayLR: WarmupLR's warmup, then a linear decay to 0 at total_num_steps."""

    total_num_steps: int = setting(ge=1)
    """Optimizer steps of the whole run; required."""


@dataclass(frozen=True, kw_only=True)
class WarmupCosineLRParams(Section):
    """WarmupCosineLR: ratios of the optimizer's lr. Rise from warmup_min_ratio to 1 over warmup_num_steps,
    then a cosine decay to cos_min_ratio at total_num_steps."""

    total_num_steps: int = setting(ge=1)
    """Optimizer steps of the whole run; required."""

    warmup_min_ratio: float = setting(0.0, ge=0, le=1)
    """Fraction of the optimizer's lr at step 0."""

    warmup_num_steps: int = setting(1000, ge=0)
    """Optimizer steps of warmup."""

    cos_min_ratio: float = setting(1e-4, ge=0, le=1)
    """Fraction of the optimizer's lr at total_num_steps."""

    warmup_type: Literal["log", "linear"] = "log"
    """Shape of the rise: logarithmic in the step (DeepSpeed's default) or linear."""

    last_batch_iteration: int = setting(-1, ge=-1)
    """Index of the last step taken before this run; -1 starts the schedule from the beginning."""


SCHEDULES: dict[str, type[Section]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
}
UNSUPPORTED_SCHEDULES = ("OneCycle", "LRRangeTest")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(Section):
    """DeepSpeed's `scheduler`: the learning-rate schedule the engine builds when the user passes none.
    Stepped once per optimizer step (at the accumulation boundary), as in DeepSpeed."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"] = setting()
    """The schedule; names are case-sensitive, as in DeepSpeed."""

    params: WarmupLRParams | WarmupDecayLRParams | WarmupCosineLRParams = setting()
    """The schedule's parameters: the params class that `type` names."""

    def __post_init__(self) -> None:
        super().__post_init__()
        expected = SCHEDULES[self.type]
        if type(self.params) is not expected:
            raise ConfigError("params", f"expected {expected.__name__} for type {self.type!r}",
                              value=type(self.params).__name__)

    @classmethod
    def from_json(cls, data: object, path: str, ignored: list[str]) -> SchedulerConfig:
        if isinstance(data, Mapping) and "type" in data:
            kind = data["type"]
            if kind in UNSUPPORTED_SCHEDULES:
                raise UnsupportedKeyError(
                    join(path, "type"),
                    f"a DeepSpeed schedule zero-tiering does not support; supported: {', '.join(SCHEDULES)}",
                    value=kind,
                )
            kind = check_value(join(path, "type"), kind, type_hints(cls)["type"])
            params = SCHEDULES[kind].from_json(data.get("params"), join(path, "params"), ignored)
            data = {**data, "params": params}
        return build(cls, data, path, ignored)
