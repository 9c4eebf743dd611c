"""StepCounters: where training stands (micro-batches, optimizer steps, skipped steps), in one record that the
engine advances, the gradient path reads and checkpoints save and restore; ThroughputTimer, the samples a second
those steps took (DeepSpeed's `engine.tput_timer`)."""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class StepCounters:
    gradient_accumulation_steps: int
    """Micro-batches per optimizer step (from the config; not saved)."""
    micro_steps: int = 0
    """engine.step() calls so far."""
    global_steps: int = 0
    """Optimizer steps so far, skipped ones (fp16 overflow) included."""
    skipped_steps: int = 0
    resumed_at: int = 0
    """micro_steps when a checkpoint (saved at a boundary) was loaded: optimizer steps count from there, so a
    resume with another gradient_accumulation_steps starts a whole step (not saved)."""

    boundary: bool | None = None
    """Set by the script (DeepSpeed's set_gradient_accumulation_boundary, which Accelerate calls before each
    backward, calling step() only at a boundary): whether the running micro-batch completes a step; None: counted."""

    def in_step(self) -> int:
        """Micro-batches of the running optimizer step already through backward and step."""
        return (self.micro_steps - self.resumed_at) % self.gradient_accumulation_steps

    def at_boundary(self) -> bool:
        """The running micro-batch completes an optimizer step."""
        if self.boundary is not None:
            return self.boundary
        return self.in_step() + 1 == self.gradient_accumulation_steps

    def state_dict(self) -> dict[str, int]:
        return {"global_steps": self.global_steps, "micro_steps": self.micro_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.global_steps = state["global_steps"]
        self.micro_steps = self.resumed_at = state["micro_steps"]
        self.skipped_steps = state["skipped_steps"]


class ThroughputTimer:
    """DeepSpeed's `engine.tput_timer`: samples per second over the optimizer steps since `start_step`, timed
    from each micro-batch's forward to its `engine.step()`. Scripts read `avg_samples_per_sec()` and call
    `update_epoch_count()`."""

    def __init__(self, batch_size: int, start_step: int = 2):
        self.batch_size = batch_size
        """Samples an optimizer step consumes over all ranks (train_batch_size)."""
        self.start_step = start_step
        """Optimizer steps left out of the average (the first ones build buffers and read the trace)."""
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self._started: float | None = None

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        if self._started is None:
            self._started = time.perf_counter()

    def stop(self, global_step: bool = False) -> None:
        """End the running micro-batch's interval; `global_step`: it completed an optimizer step."""
        if self._started is None:
            return
        elapsed = time.perf_counter() - self._started
        self._started = None
        self.micro_step_count += 1
        self.step_elapsed_time += elapsed
        if global_step:
            self.global_step_count += 1
            if self.global_step_count > self.start_step:
                self.total_elapsed_time += self.step_elapsed_time
            self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples a second over the timed steps; -1 before any step past `start_step` (as DeepSpeed)."""
        steps = self.global_step_count - self.start_step
        if steps <= 0 or self.total_elapsed_time <= 0:
            return -1.0
        return self.batch_size * steps / self.total_elapsed_time
