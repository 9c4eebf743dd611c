"""`zero.initialize`: deepspeed.initialize's call shape, building a ZeroEngine from a model and a config.

The recipe: load the config; cut the model into units; make the swap manager (budgets.py), the optimizer
driver and the gradient path; let the placement the stage asks for build the units' state in its tiers; hand
all of it to the engine. Every collaborator is passed in where it is made.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from tiering import SwapManager, Tier, check_room
from tiering.device_tier import device_charge
from tiering.errors import fmt_bytes

from .accumulation.unit_major import UnitMajor
from .services.activations import HOMES as ACTIVATION_HOMES, ActivationOffload
from .services.budgets import (
    HOMES, compute_dtype, device_minimum, grad_dtype, host_minimum, largest_sub_group, largest_window,
    masters_are_params, nvme_segments, parks_root, reduce_dtype, swap_config, tied_head_bytes)
from .comm import DataParallel, local_device
from .services.compute_speed import SlowComputeWarning, dtype_speed, fast_alternative, slow_dtype_line
from .config import Config, ConfigError, load_config
from .services.counters import StepCounters
from .engine import ZeroEngine
from .optim.driver import AdamDriver
from .optim.gradient_copies import GradientCopies
from .optim.gradients import Gradients
from .optim.loss_scaler import LossScaler
from .services.autocast import Autocast, autocast_dtype, autocast_loss_scaler
from .optim.lr_schedules import WarmupSchedule
from .optim.overlapped_step import OverlappedStep
from .optim.param_groups import ZeroOptimizer, param_groups_from
from .optim.speculative_step import SpeculativeStep
from .params.flat_unit import FlatUnit
from .params.materialize import Materializer
from .params.partitioned import PartitionedPlacement
from .params.persistence import persistent_units
from .params.placement import Placement
from .params.pretrained import PretrainedWeights
from .params.resident import ResidentPlacement
from .params.wrap_policy import frozen_parts, split_units


def args_config(args: Any) -> str | None:
    """The config a script's parsed arguments name (add_config_arguments): --deepspeed_config, or its deprecated
    name --deepscale_config, which DeepSpeed maps onto it (both given is an error there too)."""
    given, old = getattr(args, "deepspeed_config", None), getattr(args, "deepscale_config", None)
    if given is not None and old is not None:
        raise ConfigError("deepscale_config", "given with deepspeed_config, its new name: keep one", value=old)
    return given if given is not None else old


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
               model_parameters: Iterable | None = None, training_data: Any = None, lr_scheduler: Any = None,
               config: str | os.PathLike | Mapping | None = None, config_params: Mapping | None = None,
               collate_fn: Any = None, dist_init_required: bool | None = None,
               weights: str | os.PathLike | None = None):
    """Returns (engine, optimizer, training_dataloader, lr_scheduler), as deepspeed.initialize does.

    `config` (a ds_config.json path or a dict; `config_params` is DeepSpeed's older name) sets batch sizes,
    precision, optimizer, schedule and offload. `optimizer` may be a torch.optim.Adam/AdamW (or our
    CPUAdam) whose hyperparameters are taken over; `lr_scheduler` an object or a callable taking the
    optimizer. One rank needs no process-group set-up; under torchrun the group is joined here.

    `weights` (ours, not DeepSpeed's): a safetensors checkpoint (a `save_pretrained` directory, sharded or not,
    or our export) whose tensors a model built on meta takes, read unit by unit straight into the tiers: peak
    host memory is one unit plus the budgets, never the model.
    """
    if model is None:
        raise ValueError("zero.initialize needs a model")
    source = config if config is not None else config_params
    if source is None:
        source = args_config(args)
    if source is None:
        raise ConfigError("config", "no config given: pass config='ds_config.json' or a dict")
    device = local_device()
    join = dist_init_required is not False
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    cfg = load_config(source, world_size=DataParallel.world_size_to_join(join), hidden_size=hidden)
    dp = DataParallel.from_env(device, timeout=cfg.zero_tiering.collective_timeout) if join else DataParallel()
    if cfg.optimizer is not None and optimizer is not None:  # DeepSpeed's rule: the call's overrides the config's
        warnings.warn(f"the config's optimizer section ({cfg.optimizer.type}) is ignored: the optimizer passed to "
                      "initialize trains, as DeepSpeed does", stacklevel=2)
    zo = cfg.zero_optimization
    dtype = compute_dtype(cfg)
    cast = autocast_dtype(cfg, device)
    speed = dtype_speed(cast or dtype, device)  # under autocast the matrix products run in its dtype
    if speed.slow:
        warnings.warn(slow_dtype_line(speed, device, fast_alternative(device),
                                      "torch_autocast" if cast is not None else "the config"), SlowComputeWarning,
                      stacklevel=2)
    groups = param_groups_from(model, model_parameters, optimizer, cfg)
    plan = plan_units(model, groups, dp, frozen=frozen_units(cfg))
    swap = SwapManager(swap_config(cfg, [flat for flat, _ in plan], dtype))
    driver = overlap = speculation = None
    try:
        device_need, park_root = check_device_budget(cfg, plan, model, dtype, swap)  # before any byte is written
        check_host_budget(cfg, [flat for flat, _ in plan], dtype, swap,
                          heads=tied_head_bytes(plan, model, dtype) if zo.stage == 3 else [])
        if swap.store is not None:  # a disk too small is one error now, before any byte is written
            check_room(swap.store, nvme_segments(cfg, [flat for flat, _ in plan], dtype))
        state_home = HOMES[zo.offload_optimizer.device]
        work_tier: Tier = "device" if state_home == "device" else "host"
        grad_home: Tier = "nvme" if state_home == "nvme" else work_tier  # host holds no per-parameter bytes
        driver = AdamDriver(swap, state_home=state_home, grad_home=grad_home, work_tier=work_tier,
                            grad_dtype=grad_dtype(cfg, dtype), state_format=cfg.state_format)
        counters = StepCounters(cfg.gradient_accumulation_steps)
        placement = None
        if speculates(cfg, work_tier, [flat for flat, _ in plan], dtype, swap.config.host_budget):
            # The placement is built below, with the gradient path that hands units to the speculation.
            speculation = SpeculativeStep(driver, swap, output=lambda sg: placement.step_output(sg),
                                          shard_of=lambda sg: placement.step_segment(sg))
        gradients = Gradients(driver=driver, dp=dp, counters=counters, sharded=zo.stage >= 1,
                              reduce_scatter=zo.stage >= 2,
                              param_order={id(p): i for i, p in enumerate(model.parameters())},
                              largest_unit=max((flat.padded_numel for flat, _ in plan if not flat.frozen), default=0),
                              prescale=cfg.prescale_gradients, predivide_factor=cfg.gradient_predivide_factor,
                              communication_data_type=cfg.communication_data_type, speculation=speculation,
                              reserve_device=swap.reserve_device, unreserve_device=swap.unreserve_device,
                              scratch_bytes=device_need["reduction scratch"],
                              copies=None if work_tier != "host" else GradientCopies(
                                  swap, largest_sub_group(cfg, [flat for flat, _ in plan]), reduce_dtype(cfg, dtype)))
        if zo.stage == 3 and cfg.zero_tiering.overlap_step and work_tier == "host":
            overlap = OverlappedStep()
        materialize = Materializer(model, PretrainedWeights(weights) if weights is not None else None)
        placement = build_placement(model, plan, cfg, materialize=materialize, swap=swap, driver=driver,
                                    gradients=gradients, dp=dp, device=device, dtype=dtype, overlap=overlap,
                                    speculation=speculation, park_root=park_root)
        zero_opt = ZeroOptimizer(groups)
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            lr_scheduler = lr_scheduler(zero_opt)
        elif lr_scheduler is None and cfg.scheduler is not None:
            lr_scheduler = WarmupSchedule(zero_opt, cfg.scheduler)
        activations = None
        if cfg.activation_offload != "none":
            activations = ActivationOffload(swap, ACTIVATION_HOMES[cfg.activation_offload],
                                            synchronize=cfg.activation_checkpointing.synchronize_checkpoint_boundary)
        unit_major = None  # resident parameters (stages 0-2) have no gathers to save: micro-batch by micro-batch
        if isinstance(placement, PartitionedPlacement) and cfg.zero_tiering.accumulation == "unit-major":
            unit_major = UnitMajor(model=model, units=placement.units, placement=placement, counters=counters, dp=dp)
        engine = ZeroEngine(module=model, config=cfg, placement=placement, driver=driver, gradients=gradients,
                            counters=counters, optimizer=zero_opt, lr_scheduler=lr_scheduler, dp=dp, swap=swap,
                            loss_scaler=loss_scaler(cfg) or autocast_loss_scaler(cfg, cast), compute_dtype=dtype,
                            device=device, overlap=overlap, speculation=speculation, activations=activations,
                            device_minimum=device_need, unit_major=unit_major,
                            autocast=None if cast is None else Autocast(cast, device, model))
    except BaseException:
        if speculation is not None:
            speculation.close()
        if overlap is not None:
            overlap.close()
        if driver is not None:
            driver.close()
        swap.close()  # a failed initialize leaves no nvme file and no pinned buffers behind
        raise
    loader = None
    if training_data is not None:  # DeepSpeed's: a DistributedSampler (shuffled, seed 0) on one rank too
        sampler = torch.utils.data.distributed.DistributedSampler(training_data, dp.world_size, dp.rank)
        loader = torch.utils.data.DataLoader(training_data, batch_size=cfg.train_micro_batch_size_per_gpu,
                                             sampler=sampler, collate_fn=collate_fn,
                                             drop_last=cfg.dataloader_drop_last)
        engine.training_dataloader = loader
    return engine, zero_opt, loader, lr_scheduler


def frozen_units(cfg: Config) -> str | None:
    """How frozen parameters make units (zero_tiering.frozen_units); None below stage 3, where they stay whole."""
    return cfg.zero_tiering.frozen_units if cfg.zero_optimization.stage == 3 else None


def plan_units(model: nn.Module, groups: list[dict], dp: DataParallel, *,
               frozen: str | None = None) -> list[tuple[FlatUnit, nn.Module]]:
    """Units from the wrap policy, each cut further by param group (a flat buffer has one set of
    hyperparameters); parameters outside every group are not trained and stay as they are. `frozen` (stage 3,
    zero_tiering.frozen_units): a unit's frozen parameters make units of their own after its trained ones, "layer":
    one per submodule holding only them (wrap_policy.frozen_parts), "block": one (`<name>#frozen`)."""
    group_of = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
    plan = []
    for name, module, params, still in split_units(model):
        by_group: dict[int, list] = {}
        for pname, p in params:
            if id(p) in group_of:
                by_group.setdefault(group_of[id(p)], []).append((pname, p))
        for g, members in sorted(by_group.items()):
            unit_name = name + (f"#g{g}" if len(by_group) > 1 else "")
            plan.append((FlatUnit(unit_name, members, dp.world_size, dp.rank, g), module))
        if frozen and still:
            parts = frozen_parts(name, module, still) if frozen == "layer" else [(f"{name}#frozen", module, still)]
            for part, owner, members in parts:
                plan.append((FlatUnit(part, members, dp.world_size, dp.rank, frozen=True, within=module), owner))
    return plan


def device_need(model: nn.Module, config: str | os.PathLike | Mapping, world_size: int = 1) -> dict[str, int]:
    """The least device budget `initialize(model=model, config=config)` would run in on this machine, by part
    (budgets.device_minimum), on each of `world_size` ranks, from the plan alone: nothing is built, read or
    written, no process group is joined (a model on meta will do). What the shipped configs are checked against."""
    cfg = load_config(config, world_size=world_size)
    ranks = SimpleNamespace(world_size=world_size, rank=0)  # the plan's sizes are every rank's
    plan = plan_units(model, param_groups_from(model, model.parameters(), None, cfg), ranks, frozen=frozen_units(cfg))
    device = local_device()
    return device_minimum(cfg, plan, model, compute_dtype(cfg), charge=lambda nbytes: device_charge(nbytes, device))


def check_device_budget(cfg: Config, plan: list[tuple[FlatUnit, nn.Module]], model: nn.Module, dtype: torch.dtype,
                        swap: SwapManager) -> tuple[dict[str, int], bool]:
    """The least device budget the plan runs in, by part (budgets.device_minimum), and whether the root unit is
    parked between its uses to run in it (budgets.parks_root); a budget below it is refused here, naming the
    minimum and its parts, rather than met in the middle of the first backward."""
    budget = cfg.zero_tiering.device_budget
    parks = parks_root(cfg, plan, model, dtype, charge=swap.device_tier.charge)
    parts = device_minimum(cfg, plan, model, dtype, charge=swap.device_tier.charge, parked=parks)
    need = sum(parts.values())
    if budget is not None and budget < need:
        held = ", ".join(f"{part} {fmt_bytes(n)}" for part, n in parts.items() if n)
        raise ConfigError("zero_tiering.device_budget", f"{fmt_bytes(budget)} is below the {fmt_bytes(need)} this "
                          f"model and config need on the device ({held}; activations kept there come on top): "
                          f"raise it to at least {need} bytes", value=fmt_bytes(budget))
    return parts, parks


def check_host_budget(cfg: Config, units: list[FlatUnit], dtype: torch.dtype, swap: SwapManager, *,
                      heads: list[int] = (), optimizer: bool = True) -> None:
    """A host budget below what no step can run without (budgets.host_minimum) is refused here, naming its parts,
    rather than met in the first step. The rest is the host pool's `spare`: a budget of exactly the minimum is
    lent buffers of the sizes asked, not larger cached ones."""
    parts = host_minimum(cfg, units, dtype, heads=heads, optimizer=optimizer)
    need, budget = sum(parts.values()), swap.config.host_budget
    if budget < need:
        held = ", ".join(f"{part} {fmt_bytes(n)}" for part, n in parts.items() if n)
        largest = max(units, key=lambda u: u.shard_numel).name or "root"
        raise ConfigError("zero_tiering.host_budget", f"{fmt_bytes(budget)} is below the {fmt_bytes(need)} this model "
                          f"and config need in host memory at least ({held}; the largest shard: unit {largest!r}): "
                          f"raise it to at least {need} bytes", value=fmt_bytes(budget))
    swap.pool.spare = budget - need


def build_placement(model: nn.Module, plan: list[tuple[FlatUnit, nn.Module]], cfg: Config, *,
                    materialize: Materializer, swap: SwapManager, driver: AdamDriver, gradients: Gradients, dp: DataParallel,
                    device: torch.device, dtype: torch.dtype, overlap: OverlappedStep | None,
                    speculation: SpeculativeStep | None, park_root: bool = False) -> Placement:
    """The placement the stage asks for, its units built: partitioned parameters for stage 3 (`park_root`: the root
    unit parked between its uses), resident ones below."""
    zo = cfg.zero_optimization
    if zo.stage == 3:
        return PartitionedPlacement.build(
            model, plan, materialize=materialize, driver=driver, param_home=HOMES[zo.offload_param.device], dtype=dtype,
            sub_group_size=zo.sub_group_size, persistent=persistent_units(zo, [flat for flat, _ in plan]),
            masters_are_params=masters_are_params(cfg, dtype), int8_frozen=zo.zero_quantized_nontrainable_weights,
            park_root=park_root, swap=swap, dp=dp, device=device,
            gradients=gradients, wait_for_update=waits_for_update(overlap, speculation),
            update_pending=speculation.pending if speculation is not None else None)
    return ResidentPlacement.build(model, plan, materialize=materialize, driver=driver, gradients=gradients, dp=dp, device=device,
                                   dtype=dtype, sharded=zo.stage >= 1, sub_group_size=zo.sub_group_size)


def speculates(cfg: Config, work_tier: Tier, units: list[FlatUnit], dtype: torch.dtype, host_budget: int | None) -> bool:
    """Whether the optimizer steps during the backward (zero_tiering.speculative_step): where it is served,
    stage 3 with the optimizer state and the parameters offloaded and a host budget of at least
    `speculation_room` (the step's working set and the backward's at once),
    unless turned off; turned on where it cannot be served it is an error."""
    zo = cfg.zero_optimization
    asked = cfg.zero_tiering.speculative_step
    why = None
    if not (zo.stage == 3 and work_tier == "host" and zo.offload_param.device != "none"):
        why = ("served with stage 3 and offload_optimizer and offload_param cpu or nvme only (below stage 3 "
               "gradients are reduced after the backward, so there is nothing to step during it; without "
               "offload_optimizer the device steps; a shard resting on the device would need a second copy there "
               f"until validation); this config has stage {zo.stage}, offload_optimizer "
               f"{zo.offload_optimizer.device} and offload_param {zo.offload_param.device}")
    elif host_budget is not None and host_budget < (room := speculation_room(cfg, units, dtype)):
        why = (f"the host budget ({fmt_bytes(host_budget)}) must hold the step's working set and the backward's at "
               f"once: at least {fmt_bytes(room)} here (2 x (a sub-group's state and gradient + the largest "
               "parameter shard)); raise zero_tiering.host_budget or lower sub_group_size")
    if asked and why is not None:
        raise ConfigError("zero_tiering.speculative_step", why, value=True)
    return why is None and asked is not False


def speculation_room(cfg: Config, units: list[FlatUnit], dtype: torch.dtype) -> int:
    """Host bytes a speculative step needs beside the backward: 2 x (the largest sub-group's master and moments as
    the state format stores them, its fp32 gradient, and the largest parameter shard)."""
    largest = max((u.shard_numel for u in units), default=0)
    return 2 * (largest_window(cfg, dtype, units, master=True) + dtype.itemsize * largest)


def waits_for_update(overlap: OverlappedStep | None, speculation: SpeculativeStep | None):
    """What a gather of unit `index` waits for: a step on its thread (overlap_step) to have updated it, after a
    speculative step not yet validated that stepped it was abandoned."""
    def wait(index: int) -> None:
        if speculation is not None:
            speculation.before_gather(index)
        if overlap is not None:
            overlap.wait_unit(index)
    return wait


def loss_scaler(cfg: Config) -> LossScaler | None:
    """fp16's loss scaler as the config sets it (dynamic when loss_scale is 0), None without fp16."""
    if not cfg.fp16.enabled:
        return None
    f = cfg.fp16
    dynamic = f.loss_scale == 0
    return LossScaler(scale=2.0**f.initial_scale_power if dynamic else f.loss_scale, dynamic=dynamic,
                      window=f.loss_scale_window, hysteresis=f.hysteresis,
                      consecutive_hysteresis=f.consecutive_hysteresis, min_scale=f.min_loss_scale)
