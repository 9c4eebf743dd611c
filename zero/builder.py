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
    if zo.stage == 3:
        raise ConfigError("zero_optimization.stage", "stage 3 needs the ZeRO-3 partitioner, not built yet", value=3)

    compute_dtype = torch.bfloat16 if cfg.bf16.enabled else torch.float16 if cfg.fp16.enabled else torch.float32
    model.to(device)
    groups = param_groups_from(model, model_parameters, optimizer, cfg)
    group_of = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
    units, masters = [], []
    for name, _, params in split_units(model):
        by_group: dict[int, list] = {}
        for pname, p in params:
            if id(p) in group_of:
                by_group.setdefault(group_of[id(p)], []).append((pname, p))
        for g, members in sorted(by_group.items()):
            unit = FlatUnit(name + (f"#g{g}" if len(by_group) > 1 else ""), members, dp.world_size, dp.rank, g)
            units.append(unit)
            masters.append(unit.flatten(torch.empty(unit.padded_numel, dtype=torch.float32, device=device)))
    model.to(compute_dtype)
    flats = []
    for unit, master in zip(units, masters):
        flat = master.to(compute_dtype)
        unit.bind(flat)
        flats.append(flat)

    manager = SwapManager(swap_config(cfg, units))
    state_home = HOMES[zo.offload_optimizer.device]
    work_tier: Tier = "device" if state_home == "device" else "host"
    driver = AdamDriver(manager, state_home=state_home, grad_home=work_tier, work_tier=work_tier)
    sharded = zo.stage >= 1
    for index, (unit, master) in enumerate(zip(units, masters)):
        start = unit.shard_start if sharded else 0
        length = unit.shard_numel if sharded else unit.padded_numel
        chunk = zo.sub_group_size or length
        for k, offset in enumerate(range(0, length, chunk)):
            numel = min(chunk, length - offset)
            sg = driver.add(f"{unit.name or 'root'}/{k}", master.narrow(0, start + offset, numel).cpu(), unit.group)
            sg.owner = (index, offset)
    del masters

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
                        compute_dtype=compute_dtype, device=device)
    loader = None
    if training_data is not None:
        sampler = None
        if dp.world_size > 1:
            sampler = torch.utils.data.distributed.DistributedSampler(training_data, dp.world_size, dp.rank)
        loader = torch.utils.data.DataLoader(training_data, batch_size=cfg.train_micro_batch_size_per_gpu,
                                             sampler=sampler, collate_fn=collate_fn)
    return engine, zero_opt, loader, lr_scheduler


def swap_config(cfg: Config, units: list[FlatUnit]) -> SwapConfig:
    """Tier budgets from the zero_tiering section; where unset, the host budget holds everything homed on
    the host plus a working window of the largest sub-group's state."""
    zo, zt = cfg.zero_optimization, cfg.zero_tiering
    sharded = zo.stage >= 1
    shard_bytes = [4 * (u.shard_numel if sharded else u.padded_numel) for u in units]
    sub_group_bytes = min(max(shard_bytes, default=0), 4 * zo.sub_group_size or max(shard_bytes, default=0))
    window = 4 * 4 * sub_group_bytes  # four segments (master, grad, two moments) of up to four sub-groups
    offload = zo.offload_optimizer.device
    homed_on_host = {"none": 0, "cpu": 4 * sum(shard_bytes), "nvme": sum(shard_bytes)}[offload]
    nvme = None
    if offload == "nvme":
        nvme = NvmeStoreConfig(nvme_path=zo.offload_optimizer.nvme_path, budget=zt.nvme_budget,
                               aio=cfg.to_aio_config())
    return SwapConfig(
        host_budget=zt.host_budget if zt.host_budget is not None else homed_on_host + window,
        device_budget=zt.device_budget,
        nvme=nvme,
        prefetch_bytes=2 * 3 * sub_group_bytes if zt.prefetch else 0,
        checksums=zt.checksums,
        pin=zo.offload_optimizer.pin_memory if torch.cuda.is_available() else False,
    )
