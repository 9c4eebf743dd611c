"""transformers' `resize_token_embeddings` on a model built under our zero.Init, keeping the rows it adds.

transformers builds the resized embedding (and head) on the old weight's device and writes the rows it adds (the
old rows' mean and covariance, or `_init_weights`' draw) before any GatheredParameters names the new module. Our
partitioned parameter's placeholder is a meta tensor (DeepSpeed's: an empty one on the accelerator), so the new
module was built on meta and those rows were lost: zeros, where plain PyTorch and DeepSpeed have the values. Each of
transformers' two resize helpers runs with the old weight gathered: its device is then the host's, so the new
module is real from the start and keeps every row (`initialize` partitions it as any parameter built whole)."""
from __future__ import annotations

import functools
from collections.abc import Callable

from ..params.ds_param import owner_of
from ..params.gathered import GatheredParameters

RESIZERS = ("_get_resized_embeddings", "_get_resized_lm_head")
"""transformers' PreTrainedModel methods that build the new module from the old one (their first argument)."""


def install() -> None:
    """Wrap the resize helpers (once; what they do is unchanged for a parameter nobody partitioned)."""
    from transformers import PreTrainedModel

    for name in RESIZERS:
        original = getattr(PreTrainedModel, name, None)
        if original is not None and not getattr(original, "zero_gathers", False):
            setattr(PreTrainedModel, name, _old_weight_gathered(original))


def _old_weight_gathered(resize: Callable) -> Callable:
    @functools.wraps(resize)
    def wrapped(self, old, *args, **kwargs):
        weight = getattr(old, "weight", None)
        if weight is None or not weight.is_meta or owner_of(weight) is None:
            return resize(self, old, *args, **kwargs)
        with GatheredParameters([weight]):
            return resize(self, old, *args, **kwargs)

    wrapped.zero_gathers = True
    return wrapped
