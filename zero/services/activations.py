"""Activation offload: the tensors autograd saves during the forward outside recomputed regions become swap
segments, copied off the device as the forward goes and read back ahead of the backward.

With activation checkpointing (torch.utils.checkpoint, reentrant or not; a Hugging Face model's
gradient_checkpointing_enable()) those are each checkpointed block's inputs, plus what the layers outside the
blocks save (embeddings, the head); inside a checkpointed region torch's own hooks take over, and what the
recomputation saves in the backward is used at once. Without checkpointing it is every activation.

The engine's forward runs inside `saving()`, a `torch.autograd.graph.saved_tensors_hooks`. A saved tensor is
handed to the swap manager as it is (`adopt`: no copy on the compute stream), counted against the device budget
until its copy to the host has landed, and from there moves like any segment: to nvme when the host is short of
room (home "nvme"), back to the device ahead of its use along the trace (each micro-batch names its activations
in the order it saves them, so the names repeat step after step). The backward's unpack copies the segment's
device bytes into a tensor of autograd's own: a segment's buffer is never lent out, so nothing autograd keeps
can see it reused. A segment is removed once autograd drops what the pack returned (the graph is freed after its
backward), at the next pack, unpack or backward's end: never from a finalizer, which may run anywhere.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn

from tiering import SwapManager, Tier

MIN_BYTES = 4096
"""Smaller saved tensors stay where autograd put them: a host buffer is at least a page."""

PREFIX = "activation"

HOMES: dict[str, Tier] = {"device": "device", "cpu": "host", "nvme": "nvme"}
"""The tier each zero_tiering.activation_offload setting rests activations in."""


class SavedActivation:
    """What autograd keeps for one offloaded tensor: its segment's name, and what tells whether the tensor was
    written in place after it was saved (autograd's own check cannot see through the hooks). A write while the
    copy off the device is in flight would tear the copy; one seen later through the tensor, still alive, is the
    write autograd reports. (Once the copy has landed and the tensor is gone, the saved bytes are safe and a
    write through another view of them goes unseen, as with torch.autograd.graph.save_on_cpu.)"""

    __slots__ = ("name", "source", "version", "modified", "nbytes", "_watch", "_dead", "__weakref__")

    def __init__(self, name: str, tensor: torch.Tensor, dead: collections.deque):
        self.name = name
        self.source = weakref.ref(tensor)
        self.version = tensor._version
        self.modified = False
        self.nbytes = tensor.numel() * tensor.element_size()
        self._watch: torch.Tensor | None = tensor.detach()
        """Shares the tensor's version counter until the copy off the device has landed."""
        self._dead = dead

    def landed(self) -> None:
        """The copy off the device has its bytes: a write since then no longer tears it."""
        self.note_version()
        self._watch = None

    def note_version(self) -> None:
        for tensor in (self._watch, self.source()):
            if tensor is not None and tensor._version != self.version:
                self.modified = True

    def check_unchanged(self) -> None:
        self.note_version()
        if self.modified:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"the activation saved as {self.name!r} ({self.nbytes} bytes) was written after the forward saved "
                f"it (its version was {self.version})")

    def __del__(self) -> None:
        self._dead.append(self.name)  # removed by ActivationOffload.collect, on a thread that may call the swap


class ActivationOffload:
    """The saved-tensor hooks of one engine. `home`: the tier the activations rest in ("device": they stay, only
    counted). `synchronize`: wait for each copy off the device before the forward goes on."""

    def __init__(self, swap: SwapManager, home: Tier, *, synchronize: bool = False):
        self.swap = swap
        self.home = home
        self.synchronize = synchronize
        self._dead: collections.deque[str] = collections.deque()
        self._live: dict[tuple, weakref.ref] = {}
        """This forward's saved tensors by identity: a tensor saved twice (a mask every layer reads) is one
        segment."""
        self._prefix = ""
        self._count = 0
        self._serial = itertools.count()
        self.saved_bytes = 0
        """Bytes of activations handed to the swap manager so far (the report's running total)."""
        self.saved = 0

    @contextlib.contextmanager
    def saving(self, micro_batch: int, wrap: Callable | None = None) -> Iterator[None]:
        """Around one forward: what it saves becomes segments named `activation<micro_batch>/<k>` in saving order.
        `wrap(pack, unpack)`: the hooks to run instead, ahead of these (autocast.py's)."""
        self.collect()
        self._prefix, self._count = f"{PREFIX}{micro_batch}/", 0
        hooks = (self._pack, self._unpack) if wrap is None else wrap(self._pack, self._unpack)
        try:
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
                yield
        finally:
            for ref in self._live.values():
                saved = ref()
                if saved is not None:
                    saved.note_version()
            self._live.clear()

    def offloads(self, tensor: torch.Tensor) -> bool:
        """Whether a saved tensor becomes a segment: a contiguous activation on the device of at least MIN_BYTES.
        Parameters (and views of them) stay: the placement owns their bytes."""
        return (tensor.layout == torch.strided and tensor.device == self.swap.device_tier.device
                and tensor.is_contiguous() and tensor.numel() * tensor.element_size() >= MIN_BYTES
                and not isinstance(tensor, nn.Parameter) and not isinstance(tensor._base, nn.Parameter)
                and not (tensor.is_leaf and tensor.requires_grad))

    def _pack(self, tensor: torch.Tensor):
        if not self.offloads(tensor):
            return tensor
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.dtype,
               tensor._version)
        ref = self._live.get(key)
        saved = ref() if ref is not None else None
        if saved is not None and saved.source() is not None:  # alive: its address is not yet another tensor's
            return saved
        self.collect()
        name = f"{self._prefix}{self._count}"
        self._count += 1
        if name in self.swap.segments:  # a graph kept from an earlier forward (retain_graph) still holds it
            name = f"{name}~{next(self._serial)}"
        saved = SavedActivation(name, tensor, self._dead)
        handle = self.swap.adopt(name, tensor.detach(), home=self.home)
        if self.home != "device":  # on the device the segment keeps the tensor: watched to the end
            handle.add_done_callback(functools.partial(_landed, weakref.ref(saved)))
        if self.synchronize:
            handle.wait()
        self._live[key] = weakref.ref(saved)
        self.saved_bytes += saved.nbytes
        self.saved += 1
        return saved

    def _unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        self.collect()
        saved.check_unchanged()
        with self.swap.held(saved.name) as view:
            if self.home == "device":
                return view  # the tensor autograd saved: its storage is torch's own, not a pool's
            out = view.clone()  # autograd's own copy: the segment's buffer goes back to the tier below
            if view.is_cuda:
                view.record_stream(torch.cuda.current_stream(view.device))  # freed once the clone has read it
        self.swap.evict(saved.name)  # a copy below is current: drops the device copy, nothing written
        return out

    def collect(self) -> None:
        """Remove the segments of the activations autograd has let go of."""
        while True:
            try:
                name = self._dead.popleft()
            except IndexError:
                return
            if name in self.swap.segments:
                self.swap.unregister(name)

    def close(self) -> None:
        self.collect()


def _landed(ref: weakref.ref, _handle) -> None:
    saved = ref()  # weak: a handle kept somewhere must not keep autograd's record alive
    if saved is not None:
        saved.landed()
