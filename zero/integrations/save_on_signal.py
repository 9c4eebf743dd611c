"""ZeroTrainingArguments(save_on_signal=True): the Trainer's checkpoint-N saved at the step a preemption signal
(SIGTERM, SIGUSR1) is noted, and training stopped, so that train(resume_from_checkpoint=True) continues it."""
from __future__ import annotations

from typing import Any

from transformers import TrainerCallback
from transformers.utils import logging

from ..services.preemption import Preemption, save_due

logger = logging.get_logger(__name__)


class SaveOnSignal(TrainerCallback):
    """ZeroTrainingArguments(save_on_signal=True): a signal noted (zero/services/preemption.py) makes the step's end
    save the Trainer's checkpoint-N (the engine's state in it, as any save) and stop training; every rank agrees on
    the step, as the engine's own save_on_signal does."""

    def __init__(self, trainer: Any):  # a ZeroTrainer
        self.trainer = trainer
        self.preemption: Preemption | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.preemption = Preemption(args.output_dir)

    def on_step_end(self, args, state, control, **kwargs):
        if save_due(self.preemption, self.trainer.engine.dp):
            control.should_save = control.should_training_stop = True
            if state.is_world_process_zero:
                logger.warning(f"a signal: saving checkpoint-{state.global_step} in {args.output_dir} and stopping")

    def on_train_end(self, args, state, control, **kwargs):
        self.preemption.close()
