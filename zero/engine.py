"""ZeroEngine: the object a training script talks to (forward, backward, step), for ZeRO stages 0-3.

Parameters are grouped into units (zero.params.unit.Unit), flattened into one buffer each; a Placement says
how they are held (resident on the device, or partitioned into shards in a tier and gathered while used), so
nothing here depends on the stage. Each unit's gradient is reduced across ranks and accumulated in fp32 into
this rank's range of it (Gradients), as soon as the placement says the unit's backward is done. At the
accumulation boundary the AdamDriver steps the sub-groups (fp32 master + moments in the tier
`offload_optimizer` names) and writes the updated weights in the compute dtype into the placement's shard,
which brings them to the full buffers. Checkpoints read the engine through `counters`, `units` and
`state_tensors()`.
"""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ContextManager, NamedTuple

import torch
from torch import nn

from tiering import SwapManager

from . import checkpoint
from .accumulation.micro_batches import loss_of
from .accumulation.unit_major import UnitMajor
from .checkpoint import sixteen_bit
from .services.activations import ActivationOffload
from .services.autocast import Autocast, cast_floating
from .comm import DataParallel
from .config import Config
from .services.counters import StepCounters, ThroughputTimer
from .services.direct_backward import DirectBackward
from .services.offload_states import OffloadStates
from .optim.driver import STATE_PARTS, AdamDriver
from .optim.gradients import Gradients
from .optim.loss_scaler import LossScaler
from .optim.overlapped_step import OverlappedStep
from .optim.speculative_step import SpeculativeStep
from .optim.param_groups import ZeroOptimizer
from .params.ds_param import OWNER, mark, set_owner
from .params.full_values import FullValues
from .params.wrap_policy import check_trainable
from .params.placement import Placement
from .params.unit import DS_STATUS, Unit
from .services.preemption import Preemption, SignalSaves, save_due
from .integrations.engine_ranks import EngineRanks
from .integrations.engine_surface import UNPROVIDED, UnprovidedEngineMethod
from .integrations.unsupported import UnsupportedFeatureError


class NonFiniteLossError(FloatingPointError):
    """The step's gradient norm is nan or inf (a nan or inf loss, or an overflow) where no fp16 loss scaler
    skips such steps: nothing of the step was applied; `step` is the optimizer step it would have been."""

    def __init__(self, step: int, grad_norm: float, loss: float | None):
        self.step, self.grad_norm, self.loss = step, grad_norm, loss
        super().__init__(
            f"step {step}: the gradient norm is {grad_norm} (the last micro-batch's loss: {loss}); nothing of this "
            "step was applied. zero_tiering.nonfinite \"skip\" skips such steps and counts them (skipped_steps)")


class StateTensor(NamedTuple):
    """One piece of the training state this rank holds, in its unit's flat coordinates."""

    unit: int
    part: str
    """'param' (the compute dtype) or one of STATE_PARTS (fp32)."""
    start: int
    numel: int
    held: Callable[[bool], ContextManager[torch.Tensor]]
    """held(write) gives the tensor for the length of a block. write: the block rewrites every element, so a
    whole segment's stored bytes are not read (a load into state a failed step left half-written needs none)."""


class ZeroEngine(FullValues, OffloadStates, SignalSaves, EngineRanks, nn.Module):
    def __init__(self, *, module: nn.Module, config: Config, placement: Placement, driver: AdamDriver,
                 gradients: Gradients, counters: StepCounters, optimizer: ZeroOptimizer, lr_scheduler,
                 dp: DataParallel, swap: SwapManager, loss_scaler: LossScaler | None, compute_dtype: torch.dtype,
                 device: torch.device, overlap: OverlappedStep | None = None,
                 speculation: SpeculativeStep | None = None, activations: ActivationOffload | None = None,
                 device_minimum: dict[str, int] | None = None, unit_major: UnitMajor | None = None,
                 autocast: Autocast | None = None):
        super().__init__()
        self.module = module
        self.config = config
        self.placement = placement
        self.units: list[Unit] = placement.units
        self._lent: dict[int, torch.Tensor] = {}
        """The private copy of its full buffer a GatheredParameters block lends a unit's parameters, by unit index."""
        self.driver = driver
        self.gradients = gradients
        self.counters = counters
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dp = dp
        self.swap = swap
        self.loss_scaler = loss_scaler
        self.compute_dtype = compute_dtype
        self.device = device
        self.overlap = overlap
        """Runs each optimizer step on a thread while the next forward runs (overlap_step), or None."""
        self.speculation = speculation
        """Steps sub-groups during the boundary's backward and validates them at the step (speculative_step), or None."""
        self.activations = activations
        """Where the forward's saved activations rest until the backward (activation_offload), or None."""
        self.autocast = autocast
        """torch.autocast around the forward (torch_autocast), or None."""
        self.tput_timer = ThroughputTimer(config.train_batch_size)
        """Samples a second of the optimizer steps (DeepSpeed's), timed from each forward to its step()."""
        self.unit_major = unit_major
        """Runs a step's micro-batches through each unit at once (train_batch), where the model allows."""
        self.schedule = "micro-batch"  # how the last step's forwards and backwards ran (or "unit-major")
        self.optimizer_seconds = 0.0  # what the last boundary's step() took on the calling thread
        self.device_minimum = device_minimum or {}  # the least device budget it runs in, by part (budgets.py)
        self._bet = True  # whether the next boundary speculates: the last step neither clipped nor overflowed
        self.stage = config.zero_optimization.stage
        self._last_grad_norm: float | None = None
        self._last_loss: torch.Tensor | None = None
        """The last micro-batch's loss, detached (read only to name a non-finite step: no sync per micro-batch)."""
        self.preemption: Preemption | None = None
        self._preemption_state: Callable[[], Any] | None = None
        self._closed = False
        self._offloaded: dict = {}  # state: the segments offload_states moved to the host (offload_states.py)
        self._trainable = [(name, p, p.requires_grad) for name, p in module.named_parameters()]  # check_trainable
        self._trained = {id(slot.param) for unit in self.units if not unit.frozen for slot in unit.flat.slots}
        self._backward_ran = False  # in this micro-batch, through engine.backward or the forward's outputs
        self.direct = DirectBackward(prologue=self._backward_prologue, epilogue=self._backward_epilogue,
                                     gradients=gradients, accumulation=self.gradient_accumulation_steps,
                                     needs_scale=lambda: self.loss_scaler is not None)
        """What a backward() called on the forward's outputs instead of engine.backward does (direct_backward.py)."""
        # zero.Init numbered the parameters it built; the others continue its numbering (DeepSpeed's are unique).
        next_id = 1 + max((p.ds_id for p in module.parameters() if hasattr(p, "ds_id")), default=-1)
        for unit in self.units:
            for slot in unit.flat.slots:
                if unit.segment is not None:
                    if not hasattr(slot.param, "ds_id"):
                        slot.param.ds_id, next_id = next_id, next_id + 1
                    mark(slot.param, slot.param.ds_id, slot.shape, self, DS_STATUS[unit.state], unit.flat.world_size)
                else:
                    set_owner(slot.param, self)

    # -- DeepSpeed's counters and sizes -------------------------------------------------------------------------

    def gradient_accumulation_steps(self) -> int:
        return self.counters.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def zero_optimization_stage(self) -> int:
        return self.stage

    def bfloat16_enabled(self) -> bool:
        return self.compute_dtype == torch.bfloat16

    def fp16_enabled(self) -> bool:
        return self.compute_dtype == torch.float16

    def torch_autocast_enabled(self) -> bool:
        return self.autocast is not None

    def torch_autocast_dtype(self) -> torch.dtype | None:
        """The dtype the forward autocasts to (torch's default for the device where the config names none)."""
        return self.autocast.dtype if self.autocast is not None else None

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        """DeepSpeed's (its default: Linear and Conv1d-3d), for scripts that read them back; not used here."""
        names = self.config.torch_autocast.lower_precision_safe_modules
        return list(names) if names is not None else [f"{c.__module__}.{c.__name__}" for c in (
            nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)]

    def __getattr__(self, name: str) -> Any:
        """What the engine lacks is asked of the wrapped model, as DeepSpeed's engine does:
        `engine.gradient_checkpointing_enable()`, `engine.generate(...)`, `engine.model` are the model's; a
        DeepSpeedEngine method neither has is an error naming it (integrations/engine_surface.py)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self._modules.get("module")
            if module is None:
                raise
            if name in UNPROVIDED and not hasattr(module, name):
                raise UnprovidedEngineMethod(name) from None
            return getattr(module, name)

    @property
    def global_samples(self) -> int:
        """Samples the optimizer steps so far have consumed over all ranks (skipped steps included, as DeepSpeed
        counts them)."""
        return self.counters.global_steps * self.config.train_batch_size

    @property
    def micro_steps(self) -> int:
        return self.counters.micro_steps

    @property
    def global_steps(self) -> int:
        return self.counters.global_steps

    @property
    def skipped_steps(self) -> int:
        return self.counters.skipped_steps

    # -- the training loop's calls ---------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_loaded("forward")
        if self.preemption is not None and self.preemption.saved is not None:
            self.close()  # saved at the last boundary on a signal; the loop has had its say about that step
            raise SystemExit(0)
        if torch.is_grad_enabled():
            self.tput_timer.start()
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            args, kwargs = cast_floating((args, kwargs), self.compute_dtype)
        saving = (None if self.activations is None or not torch.is_grad_enabled()
                  else functools.partial(self.activations.saving, self.counters.in_step()))
        if self.autocast is not None:
            with self.autocast.forward(saving):
                output = self.module(*args, **kwargs)
        elif saving is not None:
            with saving():
                output = self.module(*args, **kwargs)
        else:
            output = self.module(*args, **kwargs)
        if torch.is_grad_enabled():
            self.direct.watch(output)
        return output

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.counters.at_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's: from now on the script says which micro-batch completes a step (Accelerate sets it before
        each backward and calls step() at a boundary only), instead of the engine counting
        gradient_accumulation_steps; each backward still divides its loss by that count."""
        self.counters.boundary = bool(is_boundary)

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward of `loss` averaged over the accumulation steps (and scaled for fp16), then each unit's
        gradient reduced across ranks and accumulated in fp32 into this rank's range."""
        return self._backward(loss, self.counters.gradient_accumulation_steps)

    def _backward(self, loss: torch.Tensor, divisor: int) -> torch.Tensor:
        self._backward_prologue()
        self._last_loss = loss.detach()
        scaled = loss.float() / divisor
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.scale
        with self.direct.engine_backward():
            scaled.backward()
        self._backward_epilogue()
        return loss

    def _backward_prologue(self) -> None:
        self._check_loaded("backward")
        self._backward_ran = True
        self._finish_step()  # the gradients it accumulates into are the running step's to drop first
        check_trainable(self._trainable)
        if self.speculation is not None and self._bet and self.counters.at_boundary():
            self.speculation.begin(self.optimizer.param_groups, self.optimizer.step_count + 1, 1.0 / self.cur_scale)

    def _backward_epilogue(self) -> None:
        self.placement.finish_backward()
        if self.activations is not None:
            self.activations.collect()  # the graph is freed: its activations' segments go

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's: `loss` times fp16's loss scale, for `engine.scale(loss).backward()` (not divided by the
        accumulation steps: direct_backward.py divides the gradients); the loss itself otherwise."""
        self.direct.scaled = True
        return loss.float() * self.loss_scaler.scale if self.loss_scaler is not None else loss

    def train_batch(self, data_iter: Iterable | None = None, *,
                    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> torch.Tensor:
        """One optimizer step over gradient_accumulation_steps micro-batches drawn from `data_iter` (DeepSpeed's
        pipeline engine's call). A micro-batch is the model's input: a dict of keyword arguments, a tuple or list
        of positional ones, or one tensor. The loss is `loss_fn(output, batch)`, else the model's own (its output
        when a tensor, else its `loss`).

        Where the model allows (partitioned units, each called once a forward, micro-batches that stack), the
        step runs unit-major (zero.accumulation.unit_major): its micro-batches as one batch, each unit gathered
        once for all of their forwards and once for all of their backwards; the loss is then the model's on the
        whole step's batch (the micro-batches' mean where each holds as many counted tokens). Otherwise they run
        one after another as the forward, backward and step calls would, and the loss is the mean of theirs.
        `engine.schedule` says which ran."""
        k = self.counters.gradient_accumulation_steps
        if self.counters.in_step():
            raise RuntimeError(f"train_batch runs a whole optimizer step, but {self.counters.in_step()} of "
                               f"this step's {k} micro-batches already went through backward and step: finish it")
        if data_iter is None:
            raise ValueError("train_batch needs data_iter: an iterable of micro-batches")
        it = iter(data_iter)
        micro_batches = []
        for _ in range(k):
            try:
                micro_batches.append(next(it))
            except StopIteration:
                raise ValueError(f"train_batch needs {k} micro-batches (gradient_accumulation_steps) and data_iter "
                                 f"gave {len(micro_batches)}") from None
        loss = self.unit_major_step(micro_batches, lambda batch: loss_of(self._call(batch), batch, loss_fn))
        if loss is not None:
            return loss
        losses = []
        for batch in micro_batches:
            loss = loss_of(self._call(batch), batch, loss_fn)
            self.backward(loss)
            losses.append(loss.detach().float())
            self.step()
        return torch.stack(losses).mean()

    def unit_major_step(self, micro_batches: list[Any],
                        batch_loss: Callable[[Any], torch.Tensor]) -> torch.Tensor | None:
        """One optimizer step over `micro_batches` (gradient_accumulation_steps of them) run unit-major, where
        `batch_loss(batch)` calls the engine on the stacked batch and returns the whole step's loss (a mean over
        it, not a share of it); the loss, detached. None where the schedule cannot run this step (nothing ran: the
        caller runs the micro-batches one after another); `schedule` says which. The first call probes the model
        with one forward of `batch_loss` on a micro-batch, without autograd (zero.accumulation.probe)."""
        k = self.counters.gradient_accumulation_steps
        loop = self.unit_major is None or k == 1 or self.counters.boundary is not None  # (a script's boundary)
        stacked = None if loop else self.unit_major.plan(micro_batches, batch_loss)
        self.schedule = "micro-batch" if stacked is None else "unit-major"
        if stacked is None:
            return None
        self.counters.micro_steps += k - 1  # the step's one backward completes it: it is the boundary's
        try:
            with self.unit_major.sliced(k, stacked.rows):  # through the backward: the units recompute themselves
                loss = self.unit_major.forward(batch_loss, stacked.batch)
                if loss is not None:
                    self._backward(loss, 1)  # the whole step's loss: already the mean over its micro-batches
        except BaseException:
            self.counters.micro_steps -= k - 1
            raise
        if loss is None:  # the stacked forward failed: nothing ran, and the caller runs the micro-batches
            self.counters.micro_steps -= k - 1
            self.schedule = "micro-batch"
            return None
        self.step()
        return loss.detach()

    def _call(self, batch: Any) -> Any:
        if isinstance(batch, Mapping):
            return self(**batch)
        if isinstance(batch, (tuple, list)):
            return self(*batch)
        return self(batch)

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Called every micro-batch; the optimizer runs at the accumulation boundary, then the LR scheduler's
        `step(**lr_kwargs)` (DeepSpeed's: a Megatron-style scheduler takes e.g. the tokens seen)."""
        stray = [] if self._backward_ran else [  # a micro-batch no engine backward saw: its gradients came around
            name for name, p, _ in self._trainable if p.grad is not None and id(p) in self._trained]
        self._backward_ran = False
        if stray:
            raise RuntimeError(
                f"engine.step(): {len(stray)} parameters ({stray[0]!r} first) hold gradients no engine backward took: "
                "a backward() of tensors the engine's forward did not return, or gradients set by hand; use "
                "engine.backward(loss), or backward() of the forward's outputs")
        self._check_loaded("step")
        boundary = self.is_gradient_accumulation_boundary()
        self.counters.micro_steps += 1
        if not boundary:
            self.tput_timer.stop()
            return
        start = time.perf_counter()
        try:
            self._optimizer_step(lr_kwargs or {})
        finally:
            self.swap.end_step()  # the trace of this step drives prefetch and eviction in the next
            self.optimizer_seconds = time.perf_counter() - start
        self.tput_timer.stop(global_step=True)
        if save_due(self.preemption if self.preemption is not None and self.preemption.saved is None else None,
                    self.dp):  # every rank asks, whether or not it watches: see save_due
            self._save_for_exit()

    def _optimizer_step(self, lr_kwargs: dict) -> None:
        if self.overlap is not None:
            self.overlap.wait_all()
        grad_norm = self.gradients.norm(self.units)
        finite = bool(torch.isfinite(grad_norm).item())  # the norm is every rank's: all agree
        overflow = not finite and (self.loss_scaler is not None or self.config.zero_tiering.nonfinite == "skip")
        self.optimizer.overflow = overflow
        if not finite and not overflow:
            if self.speculation is not None:  # the early-stepped sub-groups go back to their state before it
                self.speculation.settle(self.optimizer.param_groups, self.optimizer.step_count + 1, 1.0,
                                        clipped=False, overflow=True)
            self.driver.zero_grad()
            loss = None if self._last_loss is None else self._last_loss.float().item()
            raise NonFiniteLossError(self.counters.global_steps + 1, grad_norm.item(), loss)
        self.counters.global_steps += 1
        loss_scale = self.cur_scale
        clip = None
        if not overflow and self.config.gradient_clipping > 0:
            # torch.nn.utils.clip_grad_norm_'s arithmetic, in fp32, on the unscaled norm.
            coefficient = self.config.gradient_clipping / (grad_norm / loss_scale + 1e-6)
            if coefficient.item() < 1.0:
                clip = coefficient
        rest = None  # every sub-group
        if self.speculation is not None:
            rest = self.speculation.settle(self.optimizer.param_groups, self.optimizer.step_count + 1, 1.0 / loss_scale,
                                           clipped=clip is not None, overflow=overflow)
            self._bet = clip is None and not overflow
        if overflow:
            self.counters.skipped_steps += 1
            if self.loss_scaler is not None:
                self.loss_scaler.update(overflow=True)
            self.driver.zero_grad()
            if self._last_grad_norm is None:  # DeepSpeed's ZeRO optimizers start at 0.0 (see get_global_grad_norm)
                self._last_grad_norm = 0.0
            return
        self._last_grad_norm = grad_norm.item() / loss_scale
        self.optimizer.step_count += 1
        output = self.placement.step_output
        if self.overlap is not None:
            # The hyperparameters as they are now: the scheduler moves on below while the step runs.
            groups = [dict(group) for group in self.optimizer.param_groups]
            step, scale = self.optimizer.step_count, 1.0 / loss_scale

            def run(done) -> None:
                with self.swap.untraced():  # its fetches interleave with the forward's: kept off the trace
                    self.driver.step(groups, step, scale, clip, output, read_ahead=True,
                                     on_done=lambda sg: done(sg.unit), sub_groups=rest)

            stepping = self.driver.sub_groups if rest is None else rest
            self.overlap.start(run, [sum(sg.unit == unit.index for sg in stepping) for unit in self.units])
            self.placement.step_started()
        else:
            # Where the swap manager follows no trace (the first step, or one that left the recorded order),
            # nothing reads the next sub-groups' state ahead but the driver itself.
            self.driver.step(self.optimizer.param_groups, self.optimizer.step_count, 1.0 / loss_scale, clip,
                             output, read_ahead=not self.swap.trace.ready, sub_groups=rest)
            self.placement.shards_changed(stepped=True)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=False)
        if self.lr_scheduler is not None:
            if isinstance(self.lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
                # torch warns of a scheduler stepped before its optimizer where the optimizer's own step() never
                # ran; the engine's step ran just now (in the driver): say so with torch's flag for it
                self.lr_scheduler.optimizer._opt_called = True
            self.lr_scheduler.step(**lr_kwargs)

    def _finish_step(self) -> None:
        """Before anything reads the training state: wait for an optimizer step still running on its thread
        (overlap_step), raising its error; roll back a speculative step not yet validated (the gradients then
        wait for the boundary's step, as without speculation)."""
        if self.overlap is not None:
            self.overlap.wait_all()
        if self.speculation is not None:
            self.speculation.abandon()

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict with real tensors (gathered unit by unit under stage 3); tied parameters
        appear under every name, as torch's state_dict lists them."""
        self._finish_step()
        return self.module.state_dict()

    # -- what DeepSpeed's engine also answers ----------------------------------------------------------------

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's: the model's weights in the compute dtype, written by rank 0 (zero/checkpoint/sixteen_bit.py)."""
        return sixteen_bit.save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    @contextlib.contextmanager
    def no_sync(self):
        """DeepSpeed's block whose backwards skip the gradients' reduction. One rank has nothing to skip: it
        runs the block as it is. With several ranks each micro-batch's gradient is reduced as its backward goes
        (as DeepSpeed's stages 2 and 3, which refuse no_sync too): gradient_accumulation_steps in the config
        accumulates micro-batches instead."""
        if self.dp.world_size > 1:
            raise UnsupportedFeatureError(
                "engine.no_sync() with several ranks", "set gradient_accumulation_steps in the config and call "
                "engine.backward and engine.step every micro-batch: the optimizer steps at the boundary")
        yield

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The unscaled gradient norm of the last optimizer step taken, as DeepSpeed's: None before the first
        boundary; a step skipped on an overflow leaves the norm of the step before it (DeepSpeed's optimizers stash
        it after their overflow check), or 0.0 where none was taken yet (their initial value)."""
        return self._last_grad_norm

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def zero_grad(self) -> None:
        self.module.zero_grad(set_to_none=True)

    def close(self) -> None:
        """Free every tier's buffers and remove the nvme store's file (after a step still running ends); then a
        save_on_signal signal that came after the last step boundary goes to the handler it had before (by default
        ending the process). A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        pending = self.preemption.close() if self.preemption is not None else None
        try:
            try:
                if self.speculation is not None:
                    self.speculation.close()
            finally:
                if self.overlap is not None:
                    self.overlap.close()
        finally:
            self.placement.close()
            if self.activations is not None:
                self.activations.close()
            for unit in self.units:
                for slot in unit.flat.slots:
                    if getattr(slot.param, OWNER, None) is self:
                        delattr(slot.param, OWNER)  # a closed engine gathers nothing
            if self.config.zero_tiering.trace_path:
                self.swap.write_chrome_trace(self.config.zero_tiering.trace_path)
            self.gradients.close()
            self.driver.close()
            self.swap.close()
        if pending is not None:  # a preemption signal after the last boundary: its handler's, now all is freed
            signal.raise_signal(pending)

    destroy = close  # DeepSpeed's name for it

    # -- what checkpoints read and write ----------------------------------------------------------------------

    def state_tensors(self) -> Iterator[StateTensor]:
        """Every tensor of training state this rank holds, one at a time: each trained unit's compute-dtype range,
        then each sub-group's fp32 master and moments. `unit` counts trained units only (frozen ones are weights,
        saved by name as parameters in no unit are: checkpoint/layout.py)."""
        saved = {unit.index: i for i, unit in enumerate(u for u in self.units if not u.frozen)}
        for unit in self.units:
            if not unit.frozen:
                yield StateTensor(saved[unit.index], "param", *self.placement.rank_range(unit),
                                  lambda write, unit=unit: self.placement.shard(unit, write=write, overwrite=write))
        for sg in self.driver.sub_groups:
            start = self.placement.rank_range(self.units[sg.unit])[0] + sg.offset
            for part in STATE_PARTS:
                yield StateTensor(saved[sg.unit], part, start, sg.numel,
                                  lambda write, sg=sg, part=part: self.driver.held(sg, part, dirty=write,
                                                                                   overwrite=write))

    def unapplied_gradients(self) -> list[str]:
        """Sub-groups holding gradients no optimizer step has applied yet."""
        return [sg.name for sg in self.driver.sub_groups if not sg.grad_fresh]

    def state_loaded(self) -> None:
        """The state tensors were rewritten from a checkpoint: no gradient is pending, and full buffers that
        exist take the loaded values."""
        self.driver.zero_grad()
        self.placement.shards_changed()

    # -- checkpoints (zero/checkpoint/) -----------------------------------------------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False) -> str:
        """Save the whole training state under `save_dir/tag` (default `global_step<N>`), atomically, at a
        gradient accumulation boundary; every rank calls it. Returns the tag directory. `exclude_frozen_parameters`
        (as DeepSpeed): frozen parameters (an adapter's base) are left out; the load then keeps the engine's own."""
        self._finish_step()
        try:
            return checkpoint.save_checkpoint(self, save_dir, tag=tag, client_state=client_state,
                                              save_latest=save_latest, exclude_frozen_parameters=exclude_frozen_parameters)
        finally:
            self._offloaded_home()

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, load_rng_states=False):
        """Load a checkpoint (tag None: the one `latest` names), verified against its manifest first; every
        rank calls it. Returns (tag directory, client_state), or (None, None) when there is no `latest`.
        `load_module_only` loads the weights alone (as load_optimizer_states=False with no scheduler).
        `load_rng_states` (ours) also puts the random streams back as they were at the save; DeepSpeed's load
        leaves them as the script set them, and so does this one by default."""
        if not load_module_strict:
            raise ValueError("load_checkpoint(load_module_strict=False) is not supported: a checkpoint loads "
                             "into the same model, every parameter checked against its unit layout")
        if load_module_only:
            load_optimizer_states = load_lr_scheduler_states = False
        self._finish_step()
        try:
            return checkpoint.load_checkpoint(self, load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                                              load_lr_scheduler_states=load_lr_scheduler_states,
                                              load_rng_states=load_rng_states)
        finally:
            self._offloaded_home()

