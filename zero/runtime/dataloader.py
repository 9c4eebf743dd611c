"""DeepSpeed's `deepspeed.runtime.dataloader.RepeatingLoader` (also `deepspeed.utils`'), which scripts wrap their
data loader in to draw batches forever, as `engine.train_batch(data_iter)` expects of its iterator."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class RepeatingLoader:
    """An endless iterator over `loader`: at its end, `loader` is iterated anew (a DataLoader reshuffles then, and
    a DistributedSampler draws the same order again unless the script calls its `set_epoch`)."""

    def __init__(self, loader: Iterable[Any]):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
