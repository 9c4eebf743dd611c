"""`backward()` called on what the engine's forward returned, instead of `engine.backward(loss)`: a loss computed
outside the model, two models' outputs in one loss, an output's backward with a gradient of its own (DeepSpeed
0.18.3 and later take it).

The engine's forward hooks each output tensor that has a graph. The first of them a backward reaches does what
engine.backward does before its backward (a step still running finished, the trainable set checked, the boundary's
step speculated) and queues, for the end of that backward, what it does after (each unit's gradient reduced into its
sub-groups, the activations' segments collected). engine.backward divides the loss by the accumulation steps; here
the root of the backward is out of reach (and one output may be computed from another, the loss from the logits:
dividing at each would divide twice), so each parameter's gradient is divided where it is flattened for its
reduction, once: in fp32 bit for bit engine.backward's where the accumulation steps are a power of two, within
rounding otherwise. While engine.backward runs, the hooks stand aside. Under fp16 the loss scale must be applied,
`engine.scale(loss).backward()`, else the backward is an error (as in DeepSpeed): an unscaled fp16 gradient
underflows silently.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import torch

from ..optim.gradients import Gradients


class DirectBackward:
    def __init__(self, *, prologue: Callable[[], None], epilogue: Callable[[], None], gradients: Gradients,
                 accumulation: Callable[[], int], needs_scale: Callable[[], bool]):
        self.prologue = prologue
        self.epilogue = epilogue
        self.gradients = gradients
        self.accumulation = accumulation
        self.needs_scale = needs_scale
        self.engine_running = False
        """engine.backward is running: it does the prologue, the division and the epilogue itself."""
        self.running = False
        """A direct backward's prologue ran; its epilogue is queued."""
        self.scaled = False
        """engine.scale(loss) was called for the next direct backward."""

    def watch(self, output: Any) -> None:
        """Hooks the tensors with a graph among the forward's `output` (nested in tuples, lists, dicts, dataclasses
        and namespaces)."""
        if isinstance(output, torch.Tensor):
            if output.grad_fn is not None:
                output.register_hook(self._reached)
        elif isinstance(output, Mapping):
            for value in output.values():
                self.watch(value)
        elif isinstance(output, (tuple, list)):
            for value in output:
                self.watch(value)
        elif isinstance(output, SimpleNamespace) or (dataclasses.is_dataclass(output) and not isinstance(output, type)):
            for value in vars(output).values():
                self.watch(value)

    @contextlib.contextmanager
    def engine_backward(self) -> Iterator[None]:
        self.engine_running = True
        try:
            yield
        finally:
            self.engine_running = False

    def _reached(self, grad: torch.Tensor) -> None:
        if self.engine_running or self.running:
            return
        if self.needs_scale() and not self.scaled:
            raise RuntimeError("fp16 training needs its loss scaled before backward: engine.backward(loss), or "
                               "engine.scale(loss).backward()")
        self.prologue()
        self.running = True
        self.gradients.divisor = self.accumulation()
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        self.running = self.scaled = False
        try:
            self.epilogue()
        finally:
            self.gradients.divisor = 1
