"""A tied embedding's head gradient kept off the device through the backward.

A weight shared by an nn.Embedding and a module that runs after it (the language-model head) gets two gradients in
one backward: the head's, made first, and the embedding's, made last. Autograd keeps the first in its buffer until
the second comes and adds them, so a whole gradient of the model's largest matrix sits on the device beside every
block's backward. Here the head reads the weight through `_HeadUse`, whose backward gives autograd no gradient and
sends the head's to host memory instead (the copy stream, into a buffer the host budget counts); the device budget
gets its bytes back once the copy lands and counts them again before the embedding's gradient is made. Before the
unit's reduction the head's part is added to the embedding's on the device, a chunk at a time: embedding + head,
the one add autograd would have made (addition commutes), so the gradient's bits are unchanged.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from tiering import SwapManager

from .flat_unit import ParamSlot
from .holders import holders
from .unit import GRADIENTS

STAGING = 16 << 20
"""Bytes of the device buffer the head's part comes back through, a chunk at a time (at most the weight's)."""


class _HeadUse(torch.autograd.Function):
    """The weight as the head reads it; its gradient goes to `sink`, none to the weight."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, sink: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.sink = sink
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.sink(grad)
        return None, None


def tied_heads(module: nn.Module, slots: list[ParamSlot]) -> list[tuple[ParamSlot, nn.Module, str, nn.Module]]:
    """(slot, head, the head's name for it, embedding) for each of `slots` whose parameter two submodules of
    `module` hold: an nn.Embedding and one other (the head)."""
    owners = holders(module, [slot.param for slot in slots])
    found = []
    for slot in slots:
        held = owners.get(id(slot.param), [])
        embeddings = [(m, n) for m, n in held if isinstance(m, nn.Embedding)]
        if len(held) == 2 and len(embeddings) == 1:
            (head, name), = [(m, n) for m, n in held if not isinstance(m, nn.Embedding)]
            found.append((slot, head, name, embeddings[0][0]))
    return found


def sent_this_backward(heads: Iterable[TiedHead], param: torch.Tensor) -> bool:
    """Whether, in the backward running now, the head reading `param` has sent its gradient to the host."""
    task = torch._C._current_graph_task_id()
    return any(head.slot.param is param and head.task == task for head in heads)


class TiedHead:
    """One tied weight's head gradient, from the head's backward to the unit's reduction."""

    def __init__(self, swap: SwapManager, slot: ParamSlot, head: nn.Module, name: str, embedding: nn.Module):
        self.swap, self.slot, self.name = swap, slot, name
        self.nbytes = slot.numel * slot.param.dtype.itemsize
        self.host = None  # HostBuffer holding the head's part, from its copy until it is added back
        self.task = -1  # the backward (autograd graph task) whose head part `host` holds
        self.in_flight: tuple[object, torch.Tensor] | None = None  # (copy event, the device gradient it reads)
        self.given_back = 0
        """Device bytes of the unit's gradient reservation given back while the head's part is on the host."""
        self.hooks = [head.register_forward_pre_hook(self._read_through),
                      head.register_forward_hook(self._restore, always_call=True),  # a forward that raises too
                      embedding.register_forward_hook(self._before_embedding_backward)]

    def _read_through(self, head: nn.Module, args) -> None:
        param = head._parameters[self.name]
        if torch.is_grad_enabled() and param is self.slot.param and param.requires_grad:
            head._parameters[self.name] = _HeadUse.apply(param, self._sink)

    def _restore(self, head: nn.Module, args, output) -> None:
        head._parameters[self.name] = self.slot.param

    def _sink(self, grad: torch.Tensor) -> None:
        self.land()
        task = torch._C._current_graph_task_id()
        if self.host is not None and task != self.task:  # left by a backward that raised before its reduction
            self.host.release()
            self.host = None
        self.task = task
        if self.host is not None:  # a second head use in one backward: its part joins the first's on the host
            part = self.swap.acquire_host(self.nbytes, f"{self.slot.name} head gradient, a second use")
            try:
                values = part.view(grad.dtype, tuple(grad.shape))
                self.swap.device_tier.copy(values, grad).synchronize()
                self._view().add_(values)
            finally:
                part.release()
            return
        self.host = self.swap.acquire_host(self.nbytes, f"{self.slot.name} head gradient")
        self.in_flight = (self.swap.device_tier.copy(self._view(), grad), grad)

    def _view(self) -> torch.Tensor:
        return self.host.view(self.slot.param.dtype, tuple(self.slot.shape))

    def land(self) -> None:
        """The head's copy has landed: its device gradient goes, and its bytes leave the device's count."""
        if self.in_flight is None:
            return
        event, _ = self.in_flight
        event.synchronize()
        self.in_flight = None
        self.swap.unreserve_device(self.nbytes, GRADIENTS)
        self.given_back += self.nbytes

    def _before_embedding_backward(self, embedding: nn.Module, args, output) -> None:
        if torch.is_grad_enabled() and output.requires_grad:
            output.register_hook(lambda grad: self._count_again())

    def _count_again(self) -> None:
        """The embedding's gradient is made next: its bytes are counted again."""
        self.land()
        if self.given_back:
            self.swap.reserve_device(self.given_back, f"{self.slot.name} gradient", GRADIENTS)
            self.given_back = 0

    def add_back(self) -> None:
        """Before the unit's reduction: the head's part into the parameter's gradient (the gradient itself where
        the embedding made none), through a device staging buffer a chunk at a time."""
        self.land()
        if self.host is None:
            return
        self._count_again()
        param = self.slot.param
        fresh = param.grad is None
        if fresh:
            param.grad = torch.empty_like(param)
        chunk = min(max(STAGING // param.element_size(), 1), param.numel())
        staged = chunk * param.element_size()
        self.swap.reserve_device(staged, "head gradient staging", GRADIENTS)
        try:
            staging = torch.empty(chunk, dtype=param.dtype, device=param.device)
            grad, host = param.grad.view(-1), self._view().view(-1)
            for lo in range(0, param.numel(), chunk):
                n = min(chunk, param.numel() - lo)
                self.swap.device_tier.copy(staging[:n], host[lo:lo + n]).synchronize()
                if fresh:
                    grad[lo:lo + n].copy_(staging[:n])
                else:
                    grad[lo:lo + n].add_(staging[:n])
            del staging
        finally:
            self.swap.unreserve_device(staged, GRADIENTS)
        self.host.release()
        self.host = None

    def close(self) -> None:
        self.land()
        for hook in self.hooks:
            hook.remove()
        if self.host is not None:
            self.host.release()
            self.host = None
