"""DeepSpeed's warmup schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR) over an optimizer's param groups.

Each is a pure function of an iteration count that `step()` advances once per optimizer step (at the
accumulation boundary, by the engine, after the step), starting from `last_batch_iteration` (-1: not
started), as DeepSpeed's engine drives them: optimizer step k (0-based) runs at the schedule's value at
iteration k - 1, so the first two steps both run at the bottom of the warmup (before the start, WarmupLR
and WarmupDecayLR give warmup_min_lr and WarmupCosineLR a ratio of 0).
"""
from __future__ import annotations

import math

from ..config.scheduler import SchedulerConfig, WarmupCosineLRParams, WarmupDecayLRParams, WarmupLRParams


def warmup_fraction(iteration: int, warmup_steps: int, kind: str) -> float:
    """How far warmup has come at `iteration`: log-shaped (DeepSpeed's default) or linear; 1 after it."""
    steps = max(2, warmup_steps)  # DeepSpeed counts at least 2 warmup steps (log(1) would divide by 0)
    if iteration >= steps:
        return 1.0
    if kind == "log":
        return math.log(iteration + 1) / math.log(steps)
    return iteration / steps


class WarmupSchedule:
    """Sets `param_groups[i]['lr']` from a DeepSpeed schedule; state_dict holds the iteration."""

    def __init__(self, optimizer, config: SchedulerConfig):
        self.optimizer = optimizer
        self.params = config.params
        self.kind = config.type
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.iteration = self.params.last_batch_iteration
        self._apply()

    def lr(self, iteration: int, base_lr: float) -> float:
        p = self.params
        if iteration < 0:  # not started
            return 0.0 if isinstance(p, WarmupCosineLRParams) else p.warmup_min_lr
        if isinstance(p, WarmupCosineLRParams):
            if iteration < max(2, p.warmup_num_steps):
                gamma = warmup_fraction(iteration, p.warmup_num_steps, p.warmup_type)
                return base_lr * (p.warmup_min_ratio + (1 - p.warmup_min_ratio) * gamma)
            done = iteration - max(2, p.warmup_num_steps) + 1
            span = max(1, p.total_num_steps - max(2, p.warmup_num_steps))
            cosine = (1 + math.cos(math.pi * min(done, span) / span)) / 2
            return base_lr * max(0.0, p.cos_min_ratio + (1 - p.cos_min_ratio) * cosine)
        assert isinstance(p, WarmupLRParams)
        gamma = warmup_fraction(iteration, p.warmup_num_steps, p.warmup_type)
        if isinstance(p, WarmupDecayLRParams) and iteration >= max(2, p.warmup_num_steps):
            gamma = max(0.0, (p.total_num_steps - iteration) / max(1.0, p.total_num_steps - max(2, p.warmup_num_steps)))
        return p.warmup_min_lr + (p.warmup_max_lr - p.warmup_min_lr) * gamma

    def _apply(self) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = self.lr(self.iteration, base)

    def step(self) -> None:
        self.iteration += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"iteration": self.iteration, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict) -> None:
        self.iteration = state["iteration"]
        self.base_lrs = list(state["base_lrs"])
        self._apply()
