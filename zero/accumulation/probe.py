"""Whether a model's forward can run unit-major, learned once from one forward of one micro-batch.

What breaks the schedule mostly does not show in the model's structure (a batch norm and router logits for a
load-balancing loss do, and are refused too): a unit whose module is called more than once in a forward (its
gradient is complete only after every call's backward, but each call reduces it as its slices' backward ends); a
unit whose forward reads a parameter of the root unit (a closure, a shared gate: the root's gradient would be
reduced once per slice, before the step's is complete); a unit called with an object every slice would share (a
cache each would write), or returning a tensor without the micro-batch's rows first (a position bias computed
once: its slices cannot be joined). The probe runs the forward without autograd, with every module in eval mode
and the random streams put back after, so it changes nothing a step would see (a resumed run probes again and
trains bit for bit as the one it resumes); it counts the units' calls, and a torch function mode, active only
inside a unit's forward, looks for the root's parameters among the arguments of every torch call there.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..params.unit import Unit

PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)
"""Values a unit may be called with besides tensors: every slice sees them as they are."""


class StackedLossRefused(Exception):
    """Raised by a step's `batch_loss` when its loss on the stacked batch would not be the one the micro-batches
    add up to (a Hugging Face model whose loss ignores the Trainer's item count: the plain Trainer sums the
    micro-batches' means); its message is the reason, and the step runs micro-batch by micro-batch from then on."""


def refusal(model: nn.Module, units: list[Unit], root: list[Unit], forward: Callable[[], Any], rows: int,
            device: torch.device) -> str | None:
    """Why `model` cannot run unit-major (None: it can), from `forward()`: one forward of a micro-batch of `rows`
    rows through the engine. `units`: those run a slice at a time; `root`: the units whose parameters they must
    not read."""
    calls: dict[int, int] = {}
    inside: list[Unit] = []
    found: list[str] = []
    reads = _RootReads({id(slot.param): slot for unit in root for slot in unit.flat.slots}, inside)

    def enter(unit: Unit, args: tuple, kwargs: dict) -> None:
        calls[unit.index] = calls.get(unit.index, 0) + 1
        inside.append(unit)
        shared = [v for v in tree_flatten((args, kwargs))[0] if not isinstance(v, (torch.Tensor, *PLAIN))]
        if shared:
            found.append(f"unit {unit.name!r} is called with a {type(shared[0]).__name__}, which every micro-batch "
                         "slice would share")

    def leave(unit: Unit, output: Any) -> None:
        inside.pop()
        for value in tree_flatten(output)[0]:
            if isinstance(value, torch.Tensor) and (value.dim() == 0 or value.shape[0] != rows):
                found.append(f"unit {unit.name!r} returns a tensor of shape {tuple(value.shape)} without the "
                             f"micro-batch's {rows} rows first (its slices cannot be joined)")
                return

    hooks = []
    for unit in units:
        hooks.append(unit.module.register_forward_pre_hook(
            lambda m, args, kwargs, unit=unit: enter(unit, args, kwargs), with_kwargs=True))
        hooks.append(unit.module.register_forward_hook(lambda m, args, out, unit=unit: leave(unit, out)))
    modes = [(m, m.training) for m in model.modules()]
    try:
        with torch.no_grad(), _random_streams_kept(device), reads:
            model.eval()
            forward()
    except StackedLossRefused as exc:
        return str(exc)
    finally:
        for module, training in modes:
            module.training = training
        for hook in hooks:
            hook.remove()
    twice = [u for u in units if calls.get(u.index, 0) > 1]
    if twice:
        return (f"unit {twice[0].name!r} is called {calls[twice[0].index]} times in one forward (its gradient is "
                "complete only after every call's backward)")
    if reads.found is not None:
        unit, slot = reads.found
        return (f"unit {unit.name!r} reads the root unit's parameter {slot.name!r} in its forward (the root's "
                "gradient would be reduced before the step's is complete)")
    return found[0] if found else _by_structure(model)


def _by_structure(model: nn.Module) -> str | None:
    """What the model's modules and config say before any forward: a batch norm (over the whole step's batch at
    the root, its running statistics updated twice in a unit: in the forward and again in the recomputation), or
    router logits returned for a load-balancing loss (a unit's slices make them without autograd: the loss would
    train no router)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._NormBase) and (
                isinstance(module, nn.modules.batchnorm._BatchNorm) or module.track_running_stats):
            return (f"module {name!r} is a {type(module).__name__}, whose statistics a batch sliced or recomputed "
                    "would change")
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        return ("the model returns its router logits (config.output_router_logits) for a load-balancing loss, which "
                "a unit's slices would make without gradients")
    return None


@contextlib.contextmanager
def _random_streams_kept(device: torch.device):
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        yield


class _RootReads(TorchFunctionMode):
    """Notes the first torch call made inside a unit's forward with one of the root unit's parameters."""

    def __init__(self, params: dict[int, Any], inside: list[Unit]):
        super().__init__()
        self.params = params
        self.inside = inside
        self.found: tuple[Unit, Any] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.inside and self.found is None:
            for value in tree_flatten((args, kwargs))[0]:
                slot = self.params.get(id(value)) if isinstance(value, nn.Parameter) else None
                if slot is not None:
                    self.found = (self.inside[-1], slot)
                    break
        return func(*args, **kwargs)
