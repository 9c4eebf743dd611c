"""DeepSpeed's batch-size rule: train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps
* world_size. A missing one is derived from the others as DeepSpeed does (with only one of train / micro
given, accumulation is 1); a derivation that does not divide exactly is an error, not a floor."""
from __future__ import annotations

from .errors import ConfigError
from .schema import check_value

TRAIN = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
ACCUM = "gradient_accumulation_steps"


def resolve_batch_sizes(train: object, micro: object, accum: object, *, world_size: int) -> tuple[int, int, int]:
    """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps), each given value
    checked as a positive integer, missing ones (None) derived. Raises ConfigError naming the key."""
    train, micro, accum = (None if value is None else check_value(key, value, int, {"ge": 1})
                           for key, value in ((TRAIN, train), (MICRO, micro), (ACCUM, accum)))
    if train is None and micro is None:
        raise ConfigError(TRAIN, f"missing: set {TRAIN} or {MICRO} (or both, with {ACCUM})")
    if micro is None:
        accum = accum or 1
        micro = _divide(train, accum * world_size, f"{ACCUM} * world_size = {accum} * {world_size}")
    elif train is None:
        accum = accum or 1
        train = micro * accum * world_size
    elif accum is None:
        accum = _divide(train, micro * world_size, f"{MICRO} * world_size = {micro} * {world_size}")
    if train != micro * accum * world_size:
        raise ConfigError(TRAIN, f"must equal {MICRO} * {ACCUM} * world_size = {micro} * {accum} * {world_size} "
                                 f"= {micro * accum * world_size}", value=train)
    return train, micro, accum


def _divide(train: int, divisor: int, what: str) -> int:
    if train % divisor:
        raise ConfigError(TRAIN, f"not divisible by {what}", value=train)
    return train // divisor
