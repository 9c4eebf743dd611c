"""ZeroEngine: the object a training script talks to (forward, backward, step), for ZeRO stages 0-3.

Parameters are grouped into units and flattened (one buffer per unit, the parameters views into it). Each
unit's gradient is reduced across ranks (all-reduce for stages 0-1, reduce-scatter from stage 2), cast to
fp32 once and accumulated into this rank's shard in its tier: after backward for stages 0-2, as soon as the
unit's backward is done for stage 3 (the Partitioner's hooks). At the accumulation boundary the AdamDriver
steps the shard's sub-groups (fp32 master + moments in the tier `offload_optimizer` names) and writes the
updated weights in the compute dtype where forward reads them: the unit's buffer, all-gathered afterwards
(stages 0-2), or the unit's parameter shard in its tier (stage 3).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from tiering import SwapManager

from .adam_driver import AdamDriver, SubGroup
from .comm import DataParallel
from .config import Config
from .flat_unit import FlatUnit
from .loss_scaler import LossScaler
from .overlapped_step import OverlappedStep
from .partitioner import Partitioner


class ZeroEngine(nn.Module):
    def __init__(self, *, module: nn.Module, config: Config, units: list[FlatUnit], flats: list[torch.Tensor],
                 driver: AdamDriver, optimizer, lr_scheduler, dp: DataParallel, manager: SwapManager,
                 loss_scaler: LossScaler | None, compute_dtype: torch.dtype, device: torch.device,
                 partitioner: Partitioner | None = None):
        super().__init__()
        self.module = module
        self.config = config
        self.units, self.flats = units, flats
        self.driver = driver
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dp = dp
        self.swap = manager
        self.loss_scaler = loss_scaler
        self.compute_dtype = compute_dtype
        self.device = device
        self.partitioner = partitioner
        if partitioner is not None:
            partitioner.reduce_grads = lambda unit: self._reduce_unit(unit.index, unit.flat, unit.full)
        self.stage = config.zero_optimization.stage
        self.gradient_accumulation_steps = config.gradient_accumulation_steps
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self._scratches: dict[str, torch.Tensor] = {}
        # DeepSpeed's gradient averaging: divide by world_size before the reduction (prescale_gradients), or
        # by gradient_predivide_factor before it and by world_size / factor after it.
        self._predivide = dp.world_size if config.prescale_gradients else config.gradient_predivide_factor
        comm = config.communication_data_type
        self._comm_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}.get(comm)
        self._param_order = {id(p): i for i, p in enumerate(module.parameters())}
        self._unit_sub_groups: list[list[tuple[SubGroup, int]]] = [[] for _ in units]
        for sg in driver.sub_groups:
            unit_index, start = sg.owner
            self._unit_sub_groups[unit_index].append((sg, start))
        self._overlap = None
        if partitioner is not None and config.zero_tiering.overlap_step and driver.work_tier == "host":
            self._overlap = OverlappedStep([len(sgs) for sgs in self._unit_sub_groups])
            partitioner.wait_for_update = self._overlap.wait_unit

    # -- the training loop's calls ---------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            args, kwargs = _cast_floating((args, kwargs), self.compute_dtype)
        return self.module(*args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward of `loss` averaged over the accumulation steps (and scaled for fp16), then each unit's
        gradient reduced across ranks and accumulated in fp32 into this rank's shard."""
        self._finish_step()  # the gradients it accumulates into are the running step's to drop first
        scaled = loss.float() / self.gradient_accumulation_steps
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.scale
        scaled.backward()
        if self.partitioner is not None:
            self.partitioner.finish_backward()
        else:
            for index, (unit, flat) in enumerate(zip(self.units, self.flats)):
                self._reduce_unit(index, unit, flat)
        return loss

    def _reduce_unit(self, index: int, unit: FlatUnit, flat: torch.Tensor) -> None:
        """Flatten the unit's gradients, reduce them over ranks, add this rank's fp32 shard to the
        accumulated gradient."""
        grads = unit.flatten_grads(self._scratch("grads", unit.padded_numel, self._comm_dtype or flat.dtype,
                                                 flat.device))
        world = self.dp.world_size
        if world > 1 and self._predivide != 1.0:
            grads.div_(self._predivide)
        if self.stage >= 2:
            shard = self._scratch("shard", unit.shard_numel, grads.dtype, grads.device)
            self.dp.reduce_scatter_sum(grads, shard)
        else:
            self.dp.all_reduce_sum(grads)
            shard = grads.narrow(0, self._shard_start(unit), self._shard_numel(unit))
        if world > 1 and self._predivide != world:
            shard.div_(world / self._predivide)  # the mean over ranks
        device = torch.device("cpu") if self.driver.work_tier == "host" else shard.device
        if shard.dtype != torch.float32 or shard.device != device:  # cast to fp32 once, into reused memory
            shard = self._scratch("fp32", shard.numel(), torch.float32, device).copy_(shard)
        last = self.is_gradient_accumulation_boundary()  # this step's gradient is complete after this add
        for sg, start in self._unit_sub_groups[index]:
            self.driver.accumulate(sg, shard.narrow(0, start, sg.numel), self._param_pieces(sg) if last else None)

    def _scratch(self, role: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A reused buffer of at least `numel` elements for `role` (gradient reduction runs every micro-batch:
        fresh memory each time would be page faults on every step)."""
        buffer = self._scratches.get(role)
        if buffer is None or buffer.numel() < numel:
            largest = max(unit.padded_numel for unit in self.units)
            buffer = self._scratches[role] = torch.empty(max(numel, largest), dtype=dtype, device=device)
        return buffer[:numel]

    def _shard_start(self, unit: FlatUnit) -> int:
        return unit.shard_start if self.stage >= 1 else 0

    def _shard_numel(self, unit: FlatUnit) -> int:
        return unit.shard_numel if self.stage >= 1 else unit.padded_numel

    def step(self) -> None:
        """Called every micro-batch; the optimizer runs at the accumulation boundary."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        try:
            self._optimizer_step()
        finally:
            self.swap.end_step()  # the trace of this step drives prefetch and eviction in the next

    def _optimizer_step(self) -> None:
        self._finish_step()
        grad_norm = self._grad_norm()
        overflow = self.loss_scaler is not None and not torch.isfinite(grad_norm).item()
        self.global_steps += 1
        if overflow:
            self.skipped_steps += 1
            self.loss_scaler.update(overflow=True)
            self.driver.zero_grad()
            return
        loss_scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        self._last_grad_norm = grad_norm.item() / loss_scale
        clip = None
        if self.config.gradient_clipping > 0:
            # torch.nn.utils.clip_grad_norm_'s arithmetic, in fp32, on the unscaled norm.
            coefficient = self.config.gradient_clipping / (grad_norm / loss_scale + 1e-6)
            if coefficient.item() < 1.0:
                clip = coefficient
        self.optimizer.step_count += 1
        if self._overlap is not None:
            # The hyperparameters as they are now: the scheduler moves on below while the step runs.
            groups = [dict(group) for group in self.optimizer.param_groups]
            step, scale = self.optimizer.step_count, 1.0 / loss_scale

            def run(done) -> None:
                with self.swap.untraced():  # its fetches interleave with the forward's: kept off the trace
                    self.driver.step(groups, step, scale, clip, self._output, read_ahead=True,
                                     on_done=lambda sg: done(sg.owner[0]))

            self._overlap.start(run)
            # Units that stay gathered (persistent ones) read their updated shard at their next gather.
            self.partitioner.stale = {unit.index for unit in self.partitioner.units if unit.gathered}
        else:
            self.driver.step(self.optimizer.param_groups, self.optimizer.step_count, 1.0 / loss_scale, clip,
                             self._output)
            self._gather_params()
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=False)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def _finish_step(self) -> None:
        """Wait for an optimizer step still running on its thread (overlap_step); raise its error."""
        if self._overlap is not None:
            self._overlap.wait_all()

    def _grad_norm(self) -> torch.Tensor:
        """The global 2-norm of the accumulated (still loss-scaled) gradient, fp32, computed as torch's
        clipping does: the norm of the per-parameter norms (per parameter piece on this rank's shard)."""
        norms = [norm for _, norm in sorted(self.driver.grad_norms(self._param_pieces), key=lambda kn: kn[0])]
        local = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), dtype=torch.float32)
        if self.dp.world_size == 1:
            return local
        square = local.double().square().reshape(1)
        self.dp.all_reduce_sum(square)
        if not self._sharded_optimizer():
            square /= self.dp.world_size  # every rank holds every gradient: counted world_size times
        return square.sqrt().float().reshape(())

    def _param_pieces(self, sg: SubGroup) -> list[tuple[int, int, int]]:
        """(start, length, key) within `sg` of each parameter's part in it: the pieces whose norms torch takes,
        keyed by the parameter's place in the model so they are summed in torch's order."""
        unit_index, offset = sg.owner
        unit = self.units[unit_index]
        lo = self._shard_start(unit) + offset
        hi = lo + sg.numel
        pieces = []
        for slot in unit.slots:
            start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < end:
                pieces.append((start - lo, end - start, self._param_order[id(slot.param)]))
        return pieces

    def _sharded_optimizer(self) -> bool:
        return self.stage >= 1 and self.dp.world_size > 1

    @contextlib.contextmanager
    def _output(self, sg: SubGroup) -> Iterator[torch.Tensor]:
        """Where sub-group `sg`'s updated weights go: its slice of the unit's flat buffer (stages 0-2), or of
        the unit's parameter shard, fetched to host (or device, where it rests) and released dirty (stage 3)."""
        unit_index, start = sg.owner
        if self.partitioner is None:
            flat = self.flats[unit_index]
            yield flat.narrow(0, self._shard_start(self.units[unit_index]) + start, sg.numel)
            return
        segment = self.partitioner.units[unit_index].segment
        # The driver steps a unit's sub-groups in order, together covering its shard: the first one's fetch
        # needs no bytes, as the step rewrites them all.
        shard = self.swap.acquire(segment, self.partitioner.shard_tier, overwrite=start == 0)
        try:
            yield shard.narrow(0, start, sg.numel)
        finally:
            self.swap.release(segment, dirty=True)

    def _gather_params(self) -> None:
        if self.partitioner is not None:
            self.partitioner.refresh()  # units still gathered (persistent ones) read the updated shards
            return
        if not self._sharded_optimizer():
            return
        for unit, flat in zip(self.units, self.flats):
            shard = flat.narrow(0, unit.shard_start, unit.shard_numel).clone()
            self.dp.all_gather(shard, flat)

    # -- full parameters on demand ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def gathered_parameters(self, params: list[nn.Parameter] | None = None, modify: bool = False):
        """Inside the block the given parameters (default: all) hold their full values, as DeepSpeed's
        GatheredParameters gives them. With `modify=True` the values they hold on exit become the model's:
        the fp32 masters (and, for stage 3, the parameter shards) are rewritten; every rank must make the same
        change. Moments are kept."""
        self._finish_step()
        wanted = None if params is None else {id(p) for p in params}
        chosen = [i for i, unit in enumerate(self.units)
                  if wanted is None or any(id(slot.param) in wanted for slot in unit.slots)]
        if self.partitioner is not None:
            for i in chosen:
                self.partitioner.gather(self.partitioner.units[i])
        try:
            yield
            if modify:
                for i in chosen:
                    self._adopt_full_values(i)
        finally:
            if self.partitioner is not None:
                for i in chosen:
                    self.partitioner.release(self.partitioner.units[i])

    def _adopt_full_values(self, index: int) -> None:
        """Make unit `index`'s full buffer the truth: copy this rank's part into the masters and shard."""
        unit, flat = self.units[index], self.flats[index]
        shard = flat.narrow(0, self._shard_start(unit), self._shard_numel(unit))
        for sg, start in self._unit_sub_groups[index]:
            with self.driver.held(sg, "master", dirty=True) as master:
                master.copy_(shard.narrow(0, start, sg.numel))
        if self.partitioner is not None:
            segment = self.partitioner.units[index].segment
            self.swap.acquire(segment, self.partitioner.shard_tier).copy_(shard)
            self.swap.release(segment, dirty=True)

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict with real tensors (gathered unit by unit under stage 3); tied parameters
        appear under every name, as torch's state_dict lists them."""
        self._finish_step()
        return self.module.state_dict()

    # -- what DeepSpeed's engine also answers ----------------------------------------------------------------

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return getattr(self, "_last_grad_norm", None)

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def zero_grad(self) -> None:
        self.module.zero_grad(set_to_none=True)

    def close(self) -> None:
        """Free every tier's buffers and remove the nvme store's file (after a step still running ends)."""
        try:
            if self._overlap is not None:
                self._overlap.close()
        finally:
            if self.partitioner is not None:
                self.partitioner.remove_hooks()
            if self.config.zero_tiering.trace_path:
                self.swap.write_chrome_trace(self.config.zero_tiering.trace_path)
            self.driver.close()
            self.swap.close()

    # -- checkpoints (zero/checkpoint.py) ----------------------------------------------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False) -> str:
        """Save the whole training state under `save_dir/tag` (default `global_step<N>`), atomically, at a
        gradient accumulation boundary; every rank calls it. Returns the tag directory."""
        from .checkpoint import save_checkpoint

        if exclude_frozen_parameters:
            raise ValueError("save_checkpoint(exclude_frozen_parameters=True) is not supported: frozen "
                             "parameters are always saved (they are small next to the optimizer state)")

        self._finish_step()
        return save_checkpoint(self, save_dir, tag=tag, client_state=client_state, save_latest=save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False):
        """Load a checkpoint (tag None: the one `latest` names), verified against its manifest first; every
        rank calls it. Returns (tag directory, client_state), or (None, None) when there is no `latest`.
        `load_module_only` loads the weights alone (as load_optimizer_states=False with no scheduler)."""
        from .checkpoint import load_checkpoint

        if not load_module_strict:
            raise ValueError("load_checkpoint(load_module_strict=False) is not supported: a checkpoint loads "
                             "into the same model, every parameter checked against its unit layout")
        if load_module_only:
            load_optimizer_states = load_lr_scheduler_states = False

        self._finish_step()
        return load_checkpoint(self, load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states)


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """`value` with every floating-point tensor in it (through lists, tuples and dicts) cast to `dtype`, as
    DeepSpeed's fp16.auto_cast casts the forward's inputs; other values as they are."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_cast_floating(v, dtype) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
