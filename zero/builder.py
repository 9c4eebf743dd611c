"""`zero.initialize`: deepspeed.initialize's call shape, building a ZeroEngine from a model and a config."""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from tiering import NvmeStoreConfig, SwapConfig, SwapManager, Tier

from .adam_driver import AdamDriver
from .comm import DataParallel
from .config import Config, ConfigError, load_config
from .engine import ZeroEngine
from .flat_unit import FlatUnit
from .loss_scaler import LossScaler
from .lr_schedules import WarmupSchedule
from .materialize import Materializer
from .partitioner import Partitioner
from .wrap_policy import split_units
from .zero_optimizer import ZeroOptimizer, param_groups_from

HOMES: dict[str, Tier] = {"none": "device", "cpu": "host", "nvme": "nvme"}


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
               model_parameters: Iterable | None = None, training_data: Any = None, lr_scheduler: Any = None,
               config: str | os.PathLike | Mapping | None = None, config_params: Mapping | None = None,
               collate_fn: Any = None, dist_init_required: bool | None = None):
    """Returns (engine, optimizer, training_dataloader, lr_scheduler), as deepspeed.initialize does.

    `config` (a ds_config.json path or a dict; `config_params` is DeepSpeed's older name) sets batch sizes,
    precision, optimizer, schedule and offload. `optimizer` may be a torch.optim.Adam/AdamW (or our
    CPUAdam) whose hyperparameters are taken over; `lr_scheduler` an object or a callable taking the
    optimizer. One rank needs no process-group set-up; under torchrun the group is joined here.
    """
    if model is None:
        raise ValueError("zero.initialize needs a model")
    source = config if config is not None else config_params
    if source is None:
        source = getattr(args, "deepspeed_config", None)
    if source is None:
        raise ConfigError("config", "no config given: pass config='ds_config.json' or a dict")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dp = DataParallel.from_env(device) if dist_init_required is not False else DataParallel()
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    cfg = load_config(source, world_size=dp.world_size, hidden_size=hidden)
    if cfg.optimizer is not None and optimizer is not None:
        raise ConfigError("optimizer", "both the config and the call give an optimizer: keep one")
    zo = cfg.zero_optimization
    compute_dtype = torch.bfloat16 if cfg.bf16.enabled else torch.float16 if cfg.fp16.enabled else torch.float32
    groups = param_groups_from(model, model_parameters, optimizer, cfg)
    plan = plan_units(model, groups, dp)
    manager = SwapManager(swap_config(cfg, [unit for unit, _ in plan], compute_dtype))
    driver = None
    try:
        state_home = HOMES[zo.offload_optimizer.device]
        work_tier: Tier = "device" if state_home == "device" else "host"
        grad_home: Tier = "nvme" if state_home == "nvme" else work_tier  # host holds no per-parameter bytes
        driver = AdamDriver(manager, state_home=state_home, grad_home=grad_home, work_tier=work_tier)
        partitioner = None
        if zo.stage == 3:
            partitioner = build_partitioned(model, plan, manager, driver, cfg, dp, device, compute_dtype)
            units = [unit.flat for unit in partitioner.units]
            flats = [unit.full for unit in partitioner.units]
        else:
            units = [unit for unit, _ in plan]
            flats = build_resident(model, units, driver, cfg, device, compute_dtype)

        zero_opt = ZeroOptimizer(groups)
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            lr_scheduler = lr_scheduler(zero_opt)
        elif lr_scheduler is None and cfg.scheduler is not None:
            lr_scheduler = WarmupSchedule(zero_opt, cfg.scheduler)
        scaler = None
        if cfg.fp16.enabled:
            f = cfg.fp16
            dynamic = f.loss_scale == 0
            scaler = LossScaler(scale=2.0**f.initial_scale_power if dynamic else f.loss_scale, dynamic=dynamic,
                                window=f.loss_scale_window, hysteresis=f.hysteresis,
                                consecutive_hysteresis=f.consecutive_hysteresis, min_scale=f.min_loss_scale)
        engine = ZeroEngine(module=model, config=cfg, units=units, flats=flats, driver=driver, optimizer=zero_opt,
                            lr_scheduler=lr_scheduler, dp=dp, manager=manager, loss_scaler=scaler,
                            compute_dtype=compute_dtype, device=device, partitioner=partitioner)
    except BaseException:
        if driver is not None:
            driver.close()
        manager.close()  # a failed initialize leaves no nvme file and no pinned buffers behind
        raise
    loader = None
    if training_data is not None:
        sampler = None
        if dp.world_size > 1:
            sampler = torch.utils.data.distributed.DistributedSampler(training_data, dp.world_size, dp.rank)
        loader = torch.utils.data.DataLoader(training_data, batch_size=cfg.train_micro_batch_size_per_gpu,
                                             sampler=sampler, collate_fn=collate_fn)
    return engine, zero_opt, loader, lr_scheduler


def plan_units(model: nn.Module, groups: list[dict], dp: DataParallel) -> list[tuple[FlatUnit, nn.Module]]:
    """Units from the wrap policy, each cut further by param group (a flat buffer has one set of
    hyperparameters); parameters outside every group are not trained and stay as they are."""
    group_of = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
    plan = []
    for name, module, params in split_units(model):
        by_group: dict[int, list] = {}
        for pname, p in params:
            if id(p) in group_of:
                by_group.setdefault(group_of[id(p)], []).append((pname, p))
        for g, members in sorted(by_group.items()):
            unit_name = name + (f"#g{g}" if len(by_group) > 1 else "")
            plan.append((FlatUnit(unit_name, members, dp.world_size, dp.rank, g), module))
    return plan


def add_sub_groups(driver: AdamDriver, unit: FlatUnit, index: int, master: torch.Tensor, chunk: int,
                   master_in: str | None = None) -> None:
    """Register `master` (this rank's fp32 part of the unit) as sub-groups of at most `chunk` elements; with
    `master_in`, the fp32 segment that already holds it (the parameter shard: see masters_are_params)."""
    chunk = chunk or master.numel()
    for k, offset in enumerate(range(0, master.numel(), chunk)):
        numel = min(chunk, master.numel() - offset)
        sg = driver.add(f"{unit.name or 'root'}/{k}", master.narrow(0, offset, numel), unit.group,
                        None if master_in is None else (master_in, offset))
        sg.owner = (index, offset)


def masters_are_params(cfg: Config, dtype: torch.dtype) -> bool:
    """Stage 3 computing in fp32 with parameters and optimizer state offloaded to the same tier: each unit's
    parameter shard is its fp32 master (identical values), so the master is not stored a second time and the
    optimizer updates the shard in place. Elsewhere the master is a copy of its own: the compute dtype is
    lower, or the parameters rest in another tier than the optimizer works in."""
    zo = cfg.zero_optimization
    return (zo.stage == 3 and dtype == torch.float32
            and zo.offload_param.device == zo.offload_optimizer.device != "none")


def build_resident(model: nn.Module, units: list[FlatUnit], driver: AdamDriver, cfg: Config,
                   device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """Stages 0-2: every unit's full flat buffer stays on the device; fp32 masters come from the parameters'
    values before the cast to the compute dtype."""
    zo = cfg.zero_optimization
    model.to(device)
    masters = [unit.flatten(torch.empty(unit.padded_numel, dtype=torch.float32, device=device)) for unit in units]
    model.to(dtype)
    flats = []
    for index, (unit, master) in enumerate(zip(units, masters)):
        flat = master.to(dtype)
        unit.bind(flat)
        flats.append(flat)
        start, length = (unit.shard_start, unit.shard_numel) if zo.stage >= 1 else (0, unit.padded_numel)
        add_sub_groups(driver, unit, index, master.narrow(0, start, length).cpu(), zo.sub_group_size)
    return flats


def build_partitioned(model: nn.Module, plan: list[tuple[FlatUnit, nn.Module]], manager: SwapManager,
                      driver: AdamDriver, cfg: Config, dp: DataParallel, device: torch.device,
                      dtype: torch.dtype) -> Partitioner:
    """Stage 3: unit by unit, materialize (a model built on meta), flatten, keep this rank's shard (fp32
    master, unless masters_are_params, and moments, and the compute-dtype parameter shard, each in its tier),
    and leave the parameters as views of an empty full buffer. Peak host memory is one unit plus the tiers'
    budgets."""
    zo = cfg.zero_optimization
    param_home = HOMES[zo.offload_param.device]
    partitioner = Partitioner(manager, dp, device, "device" if param_home == "device" else "host", None)
    materialize = Materializer(model)
    for index, (unit, module) in enumerate(plan):
        materialize(unit)
        master = unit.flatten(torch.empty(unit.padded_numel, dtype=torch.float32)).narrow(
            0, unit.shard_start, unit.shard_numel)
        segment = f"{unit.name or 'root'}/param"
        manager.register(segment, dtype=dtype, shape=(unit.shard_numel,), home=param_home,
                         data=master.to(dtype)).wait()
        add_sub_groups(driver, unit, index, master, zo.sub_group_size,
                       segment if masters_are_params(cfg, dtype) else None)
        persistent = unit.numel <= zo.param_persistence_threshold
        partitioner.add(unit, module, segment, dtype, index, persistent)
        del master
    partitioner.model_hooks.append(model._register_state_dict_hook(partitioner.state_dict_hook(model)))
    materialize.buffers()
    for module in model.modules():  # buffers: to the device, floating ones in the compute dtype
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_meta:
                raise ValueError(f"buffer {name!r} of {type(module).__name__} is on the meta device: "
                                 "build it with real values (it is not a parameter, so it is not initialized)")
            setattr(module, name, buffer.to(device, dtype if buffer.is_floating_point() else buffer.dtype))
    return partitioner


def swap_config(cfg: Config, units: list[FlatUnit], dtype: torch.dtype) -> SwapConfig:
    """Tier budgets from the zero_tiering section; where unset, the host budget holds everything homed on
    the host plus a working window: the state of a few sub-groups, a few parameter shards, and (parameters
    on nvme) up to offload_param.max_in_cpu parameter elements kept in host memory as a cache."""
    zo, zt = cfg.zero_optimization, cfg.zero_tiering
    sharded = zo.stage >= 1
    shard_bytes = [4 * (u.shard_numel if sharded else u.padded_numel) for u in units]
    sub_group_bytes = min(max(shard_bytes, default=0), 4 * zo.sub_group_size or max(shard_bytes, default=0))
    parts = 3 if masters_are_params(cfg, dtype) else 4  # (master,) grad, two moments
    window = 4 * parts * sub_group_bytes  # the segments of up to four sub-groups
    offload = zo.offload_optimizer.device
    homed_on_host = parts * sum(shard_bytes) if offload == "cpu" else 0
    prefetch = 2 * parts * sub_group_bytes  # read ahead the next sub-groups' state
    max_live = reuse_distance = None
    if zo.stage == 3:
        param_bytes = [u.shard_numel * dtype.itemsize for u in units]
        window += 4 * max(param_bytes, default=0)
        homed_on_host += sum(param_bytes) if zo.offload_param.device == "cpu" else 0
        if zo.offload_param.device == "nvme":  # DeepSpeed's max_in_cpu: parameters cached on host before nvme
            window += min(zo.offload_param.max_in_cpu * dtype.itemsize, sum(param_bytes))
        # DeepSpeed counts these in parameters; the swap manager in bytes of the compute dtype.
        prefetch += zo.prefetch_bucket_size * dtype.itemsize
        max_live = zo.max_live_parameters * dtype.itemsize
        reuse_distance = zo.max_reuse_distance * dtype.itemsize
    paths = {o.nvme_path for o in (zo.offload_optimizer, zo.offload_param) if o.device == "nvme"}
    if len(paths) > 1:
        raise ConfigError("zero_optimization.offload_param.nvme_path",
                          "offload_param and offload_optimizer must share one nvme_path", value=sorted(paths))
    nvme = None
    if paths:
        nvme = NvmeStoreConfig(nvme_path=paths.pop(), budget=zt.nvme_budget, aio=cfg.to_aio_config())
    return SwapConfig(
        host_budget=zt.host_budget if zt.host_budget is not None else homed_on_host + window + prefetch,
        device_budget=zt.device_budget,
        nvme=nvme,
        prefetch_bytes=prefetch if zt.prefetch else 0,
        max_live_bytes=max_live,
        reuse_distance=reuse_distance,
        checksums=zt.checksums,
        pin=zo.offload_optimizer.pin_memory if torch.cuda.is_available() else False,
    )
