"""StepCounters: where training stands (micro-batches, optimizer steps, skipped steps), in one record that the
engine advances, the gradient path reads and checkpoints save and restore."""
from __future__ import annotations

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

    def at_boundary(self) -> bool:
        """The running micro-batch completes an optimizer step."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def state_dict(self) -> dict[str, int]:
        return {"global_steps": self.global_steps, "micro_steps": self.micro_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.global_steps = state["global_steps"]
        self.micro_steps = state["micro_steps"]
        self.skipped_steps = state["skipped_steps"]
