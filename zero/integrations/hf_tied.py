"""transformers' check of a tied pair that a checkpoint holds both of, on a model built under our zero.Init.

`from_pretrained` ties a pair of weights (an embedding and its LM head) that the checkpoint holds both of only where
their values are equal (torch `.bin` checkpoints hold both, as does a state dict saved whole): it calls
`_tied_params_are_equal`, torch.equal, on the two parameters. One our zero.Init partitioned is a meta placeholder by
then (its device says the local one, so transformers' skip for meta pairs does not apply), and torch.equal has no
meta kernel: NotImplementedError (DeepSpeed's empty placeholders compare equal whatever their values). The check runs
with the partitioned ones gathered, so it compares the values, as a plain load does."""
from __future__ import annotations

import functools
from collections.abc import Callable

from ..params.ds_param import owner_of
from ..params.gathered import GatheredParameters

CHECK = "_tied_params_are_equal"
"""transformers.modeling_utils' comparison of a tied pair (transformers 5; where a version has none, nothing is
wrapped)."""


def install() -> None:
    """Wrap the check (once; unchanged for parameters nobody partitioned)."""
    import transformers.modeling_utils as modeling_utils

    original = getattr(modeling_utils, CHECK, None)
    if original is not None and not getattr(original, "zero_gathers", False):
        setattr(modeling_utils, CHECK, _gathered(original))


def _gathered(check: Callable) -> Callable:
    @functools.wraps(check)
    def wrapped(source, target):
        partitioned = list({id(p): p for p in (source, target) if p.is_meta and owner_of(p) is not None}.values())
        if not partitioned or source.shape != target.shape:
            return check(source, target)
        with GatheredParameters(partitioned):
            return check(source, target)

    wrapped.zero_gathers = True
    return wrapped
