"""A step's micro-batches as one batch, and that batch's tensors cut back into micro-batch slices.

The unit-major schedule runs the model once on the step's batch: every tensor of a micro-batch whose first
dimension is the micro-batch's rows (those of its first tensor with a dimension, e.g. input_ids) is concatenated
along it; every other value (a scalar tensor, a flag, a mask shared by all rows) must be the same in every
micro-batch, since one forward sees it once. What cannot be stacked says why, and the step runs micro-batch by
micro-batch instead. `loss_of` finds the loss in a forward's output (train_batch's, either schedule).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class Stacked(NamedTuple):
    batch: Any
    """The micro-batches' structure with their batch tensors concatenated."""
    rows: int
    """Rows of one micro-batch (the slices' size)."""


def stack(micro_batches: list[Any]) -> Stacked | str:
    """The micro-batches as one batch, or why they cannot be one (a sentence)."""
    flat = [tree_flatten(mb) for mb in micro_batches]
    spec = flat[0][1]
    if any(s != spec for _, s in flat[1:]):
        return "the micro-batches differ in structure (their keys or nesting)"
    leaves = [values for values, _ in flat]
    rows = rows_of(micro_batches[0])
    if rows is None:
        return "a micro-batch holds no tensor with a batch dimension"
    joined = []
    for place, first in enumerate(leaves[0]):
        column = [values[place] for values in leaves]
        if isinstance(first, torch.Tensor) and first.dim() >= 1 and first.shape[0] == rows:
            if any(not isinstance(t, torch.Tensor) or t.shape != first.shape or t.dtype != first.dtype
                   for t in column):
                shapes = sorted({tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in column})
                return f"input {place} differs in shape between micro-batches ({', '.join(map(str, shapes))})"
            joined.append(torch.cat(column))
        elif isinstance(first, torch.Tensor):
            if any(not isinstance(t, torch.Tensor) or not torch.equal(t, first) for t in column):
                return (f"input {place} (shape {tuple(first.shape)}) has no batch dimension of {rows} rows and "
                        "differs between micro-batches")
            joined.append(first)
        else:
            if any(v != first for v in column):
                return f"input {place} ({type(first).__name__}) differs between micro-batches"
            joined.append(first)
    return Stacked(tree_unflatten(joined, spec), rows)


def rows_of(micro_batch: Any) -> int | None:
    """A micro-batch's rows: its first tensor's first dimension (None: it has no tensor with one)."""
    return next((t.shape[0] for t in tree_flatten(micro_batch)[0] if isinstance(t, torch.Tensor) and t.dim() >= 1),
                None)


def batch_major(value: torch.Tensor, rows: int, count: int) -> bool:
    """Whether a unit's input tensor is cut into the micro-batches' slices: two or more dimensions, the first the
    step's rows (`count` slices of `rows`). Any other tensor every slice sees whole: a 1-D one as long as the
    step's batch may be positions (a cache_position), and cutting it would be silently wrong."""
    return value.dim() >= 2 and value.shape[0] == rows * count


def cut(value: torch.Tensor, rows: int, index: int) -> torch.Tensor:
    """Slice `index` (of `rows` rows) of a tensor of the whole step."""
    return value.narrow(0, index * rows, rows)


def loss_of(output: Any, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> torch.Tensor:
    """The loss of a forward's `output` on `batch`: `loss_fn`'s, else the model's own."""
    if loss_fn is not None:
        return loss_fn(output, batch)
    if isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, Mapping):
        loss = output.get("loss")
    elif isinstance(output, (tuple, list)) and output:
        loss = output[0]
    else:
        loss = getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"train_batch found no loss in the model's output ({type(output).__name__}): give the "
                         "model its labels, or pass loss_fn(output, batch)")
    return loss
