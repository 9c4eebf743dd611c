"""The Trainer's `optimizer` and `lr_scheduler` while zero-tiering's engine trains: views of the engine's, whose
`step()` does nothing (the engine steps inside ZeroTrainer.training_step), as accelerate's DeepSpeed wrappers are."""
from __future__ import annotations

from typing import Any

from ..engine import ZeroEngine


class EngineOptimizer:
    """The Trainer's `optimizer` while the engine trains: the engine's param groups (what logs, callbacks and
    schedulers read). `step()` and `zero_grad()` do nothing: the engine stepped inside training_step (as
    accelerate's DeepSpeedOptimizerWrapper). Its state lives in the engine's tiers."""

    def __init__(self, engine: ZeroEngine):
        self.engine = engine
        self.optimizer = engine.optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    @property
    def state(self) -> dict:
        return self.optimizer.state

    @property
    def step_was_skipped(self) -> bool:
        return False

    def step(self, closure=None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict:
        raise NotImplementedError("the optimizer state lives in the engine's tiers: engine.save_checkpoint(dir) "
                                  "saves it (ZeroTrainer does, in every checkpoint-N/)")

    def load_state_dict(self, state_dict: dict) -> None:
        raise NotImplementedError("the optimizer state lives in the engine's tiers: engine.load_checkpoint(dir) "
                                  "loads it (ZeroTrainer does, on resume_from_checkpoint)")

    def __repr__(self) -> str:
        return f"EngineOptimizer({self.optimizer!r})"


class EngineScheduler:
    """The Trainer's `lr_scheduler` while the engine trains. The engine steps the real one (`scheduler`) after
    each optimizer step, so `step()` does nothing (as accelerate's DeepSpeedSchedulerWrapper);
    `get_last_lr()` gives the learning rates the last optimizer step ran at, as the plain Trainer logs them."""

    def __init__(self, engine: ZeroEngine):
        self.engine = engine
        self.last_lrs: list[float] | None = None

    @property
    def scheduler(self):
        return self.engine.lr_scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return list(self.last_lrs) if self.last_lrs is not None else self.engine.get_lr()

    def state_dict(self) -> dict:
        scheduler = self.scheduler
        return scheduler.state_dict() if scheduler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state)

    def __repr__(self) -> str:
        return f"EngineScheduler({self.scheduler!r})"
