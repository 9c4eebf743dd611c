"""`GatheredParameters` (DeepSpeed's `deepspeed.zero.GatheredParameters`): partitioned parameters whole for the
length of a block, asked of whoever holds them: zero.Init's store before `initialize`, the engine after.
Parameters nobody partitioned are left as they are, as DeepSpeed leaves them."""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from .ds_param import owner_of
from .materialize import swap_keeping_attributes


@contextlib.contextmanager
def GatheredParameters(params: torch.Tensor | Iterable[torch.Tensor] | None, modifier_rank: int | None = None,
                       fwd_module: torch.nn.Module | None = None, enabled: bool = True) -> Iterator[None]:
    """Inside the block `params` hold their full values on every rank (every rank enters it). With
    `modifier_rank`, what that rank's parameters hold on exit becomes every rank's and the model's (the fp32
    masters too, once `initialize` has made them); without, changes are dropped. A block that raises changes
    nothing. A parameter on meta that nobody partitioned gets real host memory for a block with `modifier_rank`
    (zeros, then what the block writes), which it keeps.

    `fwd_module` is accepted for DeepSpeed's signature and ignored. DeepSpeed registers the parameters as external
    parameters of that module, gathered around its later forwards, because it gathers a module's own parameters
    only. Here a unit is gathered around the forward of the module it follows (a block; the root unit, holding what
    no block holds, for the whole forward), so a parameter read anywhere inside its own block's forward (a
    submodule's, read by its parent: the case DeepSpeed's registrations serve) is whole there with no registration,
    and a root unit's parameter anywhere. A forward that reads another block's parameter is not served: that unit is
    released there, its parameters empty, and the forward fails on them (a size mismatch). Serving it would take
    gathering a unit, and taking its gradient, inside another unit's forward and backward, which the placement
    does not do."""
    if not enabled or params is None:
        yield
        return
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    owners: dict[int, tuple[object, list[torch.Tensor]]] = {}
    for p in params:
        owner = owner_of(p)
        if owner is not None:
            owners.setdefault(id(owner), (owner, []))[1].append(p)
        elif isinstance(p, nn.Parameter) and p.is_meta and modifier_rank is not None:
            # Built from a partitioned parameter's device (transformers' resize_token_embeddings makes its new
            # embedding on the old weight's, meta under zero.Init): what the block writes must not vanish into
            # meta. It gets host memory (zeros) and keeps it, a whole parameter `initialize` takes as it is, as
            # under DeepSpeed, whose partitioned stand-ins live on the CPU. What was written into it before, on
            # meta, is lost (transformers' resize runs with the old weight gathered: integrations/hf_resize.py).
            swap_keeping_attributes(p, nn.Parameter(torch.zeros(p.shape, dtype=p.dtype), p.requires_grad))
    with contextlib.ExitStack() as stack:
        for owner, owned in owners.values():
            stack.enter_context(owner.gathered_parameters(owned, modifier_rank=modifier_rank))
        yield
