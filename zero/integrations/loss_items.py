"""Whether the Trainer's loss reads the step's item count: only then is the loss of a step's micro-batches stacked
into one batch the sum of theirs, which the unit-major schedule relies on.

The plain Trainer gives every micro-batch the item count of the whole step (`num_items_in_batch`) and, for a
model that accepts loss kwargs, adds the micro-batches' losses undivided. A model whose loss divides its sum by
that count gives shares that add up to the step's loss. A model that accepts `**kwargs` but takes its own mean
(BERT's masked LM, the sequence-classification heads) is added up as means: the Trainer's loss and gradient are
the accumulation steps times a mean weighted per micro-batch, which a stacked batch's one mean is not. Which a
model does shows only as its loss is computed: Hugging Face models that read the count pass it to their
`loss_function` (the label smoother, where set, is given it by the Trainer), so those calls are watched.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn


@contextlib.contextmanager
def items_read(model: nn.Module, trainer: Any) -> Iterator[Callable[[], bool]]:
    """Within: the loss functions of `model`'s Hugging Face modules and the trainer's label smoother are watched;
    yields a function saying whether one was called with an item count."""
    seen: list[bool] = []

    def watched(function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("num_items_in_batch") is not None:
                seen.append(True)
            return function(*args, **kwargs)
        return call

    undo: list[Callable[[], None]] = []
    try:
        for module in model.modules():
            if isinstance(getattr(type(module), "loss_function", None), property):
                undo.append(_replace(module, "_loss_function", watched(module.loss_function)))
        if getattr(trainer, "label_smoother", None) is not None:
            undo.append(_replace(trainer, "label_smoother", watched(trainer.label_smoother)))
        yield lambda: bool(seen)
    finally:
        for put_back in reversed(undo):
            put_back()


def _replace(owner: Any, name: str, value: Any) -> Callable[[], None]:
    """Sets owner.name to value; returns what puts the attribute back as it was (absent, or its old value)."""
    missing = object()
    old = owner.__dict__.get(name, missing)
    setattr(owner, name, value)

    def put_back() -> None:
        if old is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, old)
    return put_back
