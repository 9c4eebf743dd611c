"""The unit-major accumulation schedule: a whole optimizer step's micro-batches in one forward and one backward,
each unit gathered once for the forward of all of them and once for their backward.

Why this way rather than an explicit unit-by-unit loop: the model's own forward stays the program (any model
whose units take and return batch-major tensors runs unchanged). The step's micro-batches are concatenated into
one batch (micro_batches.py) and the model runs once on it; when it calls a unit's module, the unit runs that
batch one micro-batch slice at a time without autograd and keeps only its inputs, a checkpoint of the unit cut
into slices (SlicedUnit). Its backward holds the unit gathered while it recomputes each slice with autograd, runs
that slice's backward and hands the unit's gradient to the reduction as the micro-batch it is: the fp32
accumulation sees the same adds in the same order as micro-batch by micro-batch, while the unit's parameters and
its sub-groups' accumulated gradient move once a step instead of once a micro-batch. Activation memory stays
one slice's inside a unit; the units' inputs for the whole step are kept (or offloaded by activation_offload).
What runs outside the units (embeddings, the head, the loss) runs on the whole batch at once.

The schedule runs where units are partitioned (stage 3: gathering is what it saves), for a model whose units
are each called once a forward and read no parameter of the root unit (probe.py, once): otherwise, or where a
step's micro-batches do not stack, the step runs micro-batch by micro-batch, as a warning says once.
"""
from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..comm import DataParallel
from ..params.partitioned import PartitionedPlacement
from ..params.unit import Unit
from ..services.counters import StepCounters
from . import probe
from .micro_batches import Stacked, batch_major, cut, rows_of, stack
from .probe import PLAIN, StackedLossRefused


class UnitMajor:
    def __init__(self, *, model: nn.Module, units: list[Unit], placement: PartitionedPlacement,
                 counters: StepCounters, dp: DataParallel):
        self.model = model
        self.placement = placement
        self.counters = counters
        self.dp = dp
        self.units = [u for u in units if u.block is not model]
        """The units run a slice at a time: those of a block (not the root's)."""
        self.refusal: str | None = None if self.units else "the model has no units besides its root"
        """Why the schedule cannot run for this model, once known."""
        self.root = [u for u in units if u.block is model]
        self._probed = False
        self._said: set[str] = set()
        self._first = 0

    # -- whether a step can run unit-major ---------------------------------------------------------------------

    def plan(self, micro_batches: list[Any], forward: Callable[[Any], Any]) -> Stacked | None:
        """The step's batch when every rank can run it unit-major, else None (every rank then runs micro-batch by
        micro-batch, and the first rank says why, once per reason). `forward(batch)`: one forward through the
        engine, which the first call runs on a micro-batch to probe the model (probe.py), on every rank."""
        stacked = stack(micro_batches)
        if self.refusal is None and not self._probed:
            self._probed = True
            first = _without_cache(self.model, micro_batches[0])
            rows = stacked.rows if isinstance(stacked, Stacked) else (rows_of(micro_batches[0]) or 0)
            self.refusal = probe.refusal(self.model, self.units, self.root, lambda: forward(first), rows,
                                         self.units[0].full.device)
        stacked = self.refusal or stacked
        able = not isinstance(stacked, str)
        if self.dp.world_size > 1:  # every rank the same schedule: a reduction per slice is a collective
            flag = torch.tensor([1.0 if able else 0.0])
            self.dp.all_reduce_sum(flag)
            if able and flag.item() < self.dp.world_size:
                able, stacked = False, "another rank's micro-batches cannot be stacked"
        if able:
            return stacked._replace(batch=_without_cache(self.model, stacked.batch))
        self._say(stacked)
        return None

    def _say(self, reason: str) -> None:
        if reason not in self._said and self.dp.rank == 0:
            self._said.add(reason)
            warnings.warn(f"train_batch runs micro-batch by micro-batch: {reason}", UnitMajorWarning, stacklevel=4)

    def forward(self, batch_loss: Callable[[Any], torch.Tensor], batch: Any) -> torch.Tensor | None:
        """The step's loss from `batch_loss(batch)`, the stacked forward; None where it raised on any rank (an
        input the slices cannot cut, as BLOOM's alibi of batch x heads rows, or out of memory on the whole batch):
        the random streams are put back, the schedule is refused from then on, and the step runs micro-batch by
        micro-batch (a real error in the model then shows there).

        The ranks agree in one all-reduce after the forward, so the fallback serves failures every rank shares (the
        same model and shapes everywhere: an input the slices cannot cut, out of memory on the whole batch where the
        ranks hold alike). A failure on some ranks alone (out of memory on one rank) where the others still have
        units to all-gather leaves those inside the forward's collectives while it waits in the agreement: every
        rank waits zero_tiering.collective_timeout, then raises RankLostError, each naming another rank as silent
        (measured with gloo, the embedding failing on one of two ranks). Failing fast instead would take a
        collective before every unit's gather in every stacked forward, for a failure this rare."""
        device = self.units[0].full.device
        streams = _rng_state(device)
        error, loss, refused = None, None, None
        try:
            loss = batch_loss(batch)
        except StackedLossRefused as exc:
            error = refused = str(exc)
        except Exception as exc:  # noqa: BLE001  (said in the refusal; the micro-batch loop raises it again)
            error = f"{type(exc).__name__}: {exc}"  # not the exception: its frames hold the whole stacked forward
        failed = torch.tensor([0.0 if error is None else 1.0])
        if self.dp.world_size > 1:  # every rank the same schedule: the backward's reductions are collectives
            self.dp.all_reduce_sum(failed)
        if not failed.item():
            return loss
        torch.set_rng_state(streams[0])
        if streams[1] is not None:
            torch.cuda.set_rng_state(streams[1], device)
        self.refusal = refused or ("another rank's stacked forward failed" if error is None else
                                   f"the step's stacked forward failed ({error})")
        self._say(self.refusal)
        return None

    # -- the sliced forward ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def sliced(self, count: int, rows: int) -> Iterator[None]:
        """Within: the step's forward and backward, its units run `count` slices of `rows` rows each. The model's
        own activation checkpointing is off meanwhile (a module's `gradient_checkpointing` flag, as Hugging Face
        and the main job's GPT keep it): the units recompute themselves."""
        self._first = self.counters.micro_steps - (count - 1)
        restore: list[Callable[[], None]] = []
        try:
            for module in self.model.modules():
                if getattr(module, "gradient_checkpointing", None) is True:
                    module.gradient_checkpointing = False
                    restore.append(lambda m=module: setattr(m, "gradient_checkpointing", True))
            by_module: dict[nn.Module, list[Unit]] = {}
            for unit in self.units:  # a block's parameters make several units (param groups, its frozen parts)
                by_module.setdefault(unit.block, []).append(unit)
            for units in by_module.values():
                restore.append(self._install(units, count, rows))
            yield
        finally:
            for undo in reversed(restore):
                undo()

    def _install(self, units: list[Unit], count: int, rows: int) -> Callable[[], None]:
        module = units[0].block
        own = module.__dict__.get("forward")  # an instance's own forward (a library's hook): put back after
        original = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            return _SliceCall(self, units, original, count, rows).run(args, kwargs)

        module.forward = forward

        def undo() -> None:
            if own is None:
                del module.forward
            else:
                module.forward = own
        return undo

    @contextlib.contextmanager
    def micro_batch(self, index: int, units: list[Unit], *, again: bool) -> Iterator[None]:
        """Around one slice's backward: the counters name the micro-batch whose gradient the reduction gets (the
        last one completes the step's), and the units await their gradients again (`again`)."""
        boundary = self.counters.micro_steps
        self.counters.micro_steps = self._first + index
        try:
            if again:
                for unit in units:
                    self.placement.backward_again(unit)
            yield
            for unit in units:
                self.placement.finish_unit_backward(unit)
        finally:
            self.counters.micro_steps = boundary


def _without_cache(model: nn.Module, batch: Any) -> Any:
    """A keyword batch for a model whose forward takes `use_cache` (Hugging Face's, or a wrapper passing its
    keywords on to one, as PEFT's) asks for no cache, unless it says otherwise: a training forward needs none, and
    one cache shared by the slices would be written by each."""
    if not isinstance(batch, dict) or "use_cache" in batch:
        return batch
    parameters = inspect.signature(model.forward).parameters
    passes_on = any(p.kind is p.VAR_KEYWORD for p in parameters.values()) and \
        getattr(getattr(model, "config", None), "use_cache", None) is not None
    return {**batch, "use_cache": False} if "use_cache" in parameters or passes_on else batch


class UnitMajorWarning(UserWarning):
    """A step asked to run unit-major runs micro-batch by micro-batch instead (the message says why)."""


class _SliceCall:
    """One call of a module on the step's batch (its units: one per parameter group): its arguments flattened,
    and what it returned rebuilt."""

    def __init__(self, schedule: UnitMajor, units: list[Unit], forward: Callable, count: int, rows: int):
        self.schedule, self.units, self.forward, self.count, self.rows = schedule, units, forward, count, rows
        self.name = units[0].name.split("#")[0]
        self.out_spec = None
        self.out_leaves: list[Any] = []
        self.out_places: list[int] = []

    def run(self, args: tuple, kwargs: dict) -> Any:
        leaves, self.spec = tree_flatten((args, kwargs))
        for value in leaves:
            if not isinstance(value, (torch.Tensor, *PLAIN)):
                raise TypeError(
                    f"train_batch runs unit {self.name!r} one micro-batch slice at a time, and its module was "
                    f"called with a {type(value).__name__}, which every slice would share (a cache the slices would "
                    "each write): call the model without it (use_cache=False), or step micro-batch by micro-batch")
        self.leaves = leaves
        self.places = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        # The anchor needs a gradient, so the backward runs even where no input needs one (the unit's parameters do).
        anchor = torch.empty(0, requires_grad=True)
        outputs = SlicedUnit.apply(self, anchor, *(leaves[i] for i in self.places))
        out = list(self.out_leaves)
        for place, tensor in zip(self.out_places, outputs):
            out[place] = tensor
        return tree_unflatten(out, self.out_spec)

    def pieces(self, tensors: tuple[torch.Tensor, ...], index: int) -> list[torch.Tensor]:
        """Micro-batch `index`'s inputs: the batch-major tensors' slices, the others whole."""
        return [cut(t, self.rows, index) if batch_major(t, self.rows, self.count) else t for t in tensors]

    def slice_forward(self, pieces: list[torch.Tensor]) -> list[Any]:
        """Run the module on one slice's input tensors (`pieces`); its output's leaves."""
        leaves = list(self.leaves)
        for place, tensor in zip(self.places, pieces):
            leaves[place] = tensor
        args, kwargs = tree_unflatten(leaves, self.spec)
        out, spec = tree_flatten(self.forward(*args, **kwargs))
        if self.out_spec is None:
            self.out_spec = spec
        elif spec != self.out_spec:
            raise TypeError(f"unit {self.name!r} returned differently structured outputs for two micro-batch "
                            "slices: train_batch cannot join them")
        return out

    def join(self, slices: list[list[Any]]) -> list[torch.Tensor]:
        """The slices' outputs as the step's: tensors concatenated along their batch dimension, other values
        (the same in every slice) kept once."""
        joined = []
        self.out_leaves = list(slices[0])
        self.out_places = []
        for place, first in enumerate(slices[0]):
            if isinstance(first, torch.Tensor):
                if first.dim() == 0 or first.shape[0] != self.rows:
                    raise TypeError(
                        f"unit {self.name!r} returned a tensor of shape {tuple(first.shape)} without the "
                        f"micro-batch's {self.rows} rows first: train_batch cannot join its slices; step micro-batch "
                        "by micro-batch")
                joined.append(torch.cat([s[place] for s in slices]))
                self.out_places.append(place)
            elif any(s[place] != first for s in slices[1:]):
                raise TypeError(f"unit {self.name!r} returned a {type(first).__name__} that differs between "
                                "micro-batch slices: train_batch cannot join them")
        return joined


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


class SlicedUnit(torch.autograd.Function):
    """A unit's module run on the step's batch a slice at a time: no autograd in the forward, each slice
    recomputed with its random state and backpropagated in the backward, the unit held gathered throughout."""

    @staticmethod
    def forward(ctx, call: _SliceCall, anchor: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        device = call.units[0].full.device
        ctx.call = call
        ctx.rng = []
        ctx.autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
        outputs = []
        for index in range(call.count):
            ctx.rng.append(_rng_state(device))
            outputs.append(call.slice_forward(call.pieces(tensors, index)))
        joined = call.join(outputs)
        ctx.save_for_backward(*tensors)
        ctx.mark_non_differentiable(*(t for t in joined if not t.is_floating_point()))
        return tuple(joined)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        call: _SliceCall = ctx.call
        units, schedule = call.units, call.schedule
        tensors = ctx.saved_tensors
        device = units[0].full.device
        needs = [t.requires_grad and t.is_floating_point() for t in tensors]
        inputs_grad: list[torch.Tensor | None] = [None] * len(tensors)
        for unit in units:  # held across the slices: gathered once for all of them
            schedule.placement.gather(unit)
        try:
            for index in range(call.count):
                with schedule.micro_batch(index, units, again=index > 0):
                    inputs = [t.detach().requires_grad_(need) for t, need in zip(call.pieces(tensors, index), needs)]
                    cpu_state, cuda_state = ctx.rng[index]
                    with torch.random.fork_rng(devices=[device] if cuda_state is not None else [],
                                               device_type=device.type), torch.enable_grad(), \
                            torch.autocast(device.type, dtype=ctx.autocast[1], enabled=ctx.autocast[0]):
                        torch.set_rng_state(cpu_state)
                        if cuda_state is not None:
                            torch.cuda.set_rng_state(cuda_state, device)
                        out = call.slice_forward(inputs)
                    pairs = [(out[place], cut(grad, call.rows, index))
                             for place, grad in zip(call.out_places, grads)
                             if grad is not None and out[place].requires_grad]
                    if pairs:
                        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                _gather_input_grads(inputs_grad, tensors, inputs, call, index)
        finally:
            for unit in units:
                schedule.placement.release(unit)
        return (None, None, *inputs_grad)


def _gather_input_grads(into: list[torch.Tensor | None], tensors: tuple[torch.Tensor, ...],
                        inputs: list[torch.Tensor], call: _SliceCall, index: int) -> None:
    """Add slice `index`'s input gradients into the step's: a sliced input's lands in its rows, one every slice
    saw whole is summed over the slices."""
    for i, (whole, piece) in enumerate(zip(tensors, inputs)):
        if not piece.requires_grad or piece.grad is None:
            continue
        if not batch_major(whole, call.rows, call.count):
            into[i] = piece.grad if into[i] is None else into[i] + piece.grad
        else:
            if into[i] is None:
                into[i] = torch.zeros_like(whole)
            into[i].narrow(0, index * call.rows, call.rows).copy_(piece.grad)
