"""What a placement's model states (parameters, gradients, optimizer state) take on each rank, by the engine's own
rules (services/budgets.py) applied to a model's units: the host and device bytes DeepSpeed's memory estimators
(runtime/zero/stage_1_and_2.py, stage3.py) print.

A model is given by its units' sizes (`unit_sizes`: the root unit's elements, then each block's), from a live model
or from counts alone (`cold_units`), and planned as a meta model of that shape, so the plan is the engine's
(plan_units) without a byte of the model: every unit trained, in one param group, computing in bf16 (fp16 takes the
same bytes) with exact state, under the config's defaults otherwise (gradient_accumulation_steps 1, sub_group_size,
the stage-3 persistence thresholds).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from tiering.device_tier import device_charge

from ..config import load_config
from ..initialize import plan_units
from ..optim.param_groups import param_groups_from
from ..params.wrap_policy import split_units
from ..services.budgets import compute_dtype, device_minimum, host_minimum

BUILD_BYTES = torch.float32.itemsize
"""Bytes a parameter takes as a script builds the model, before `initialize` takes it: torch's default dtype."""


def numel(param: torch.Tensor) -> int:
    """A parameter's elements: its `ds_numel` where it is partitioned (zero.Init, or an engine's placeholder)."""
    return int(getattr(param, "ds_numel", param.numel()))


def unit_sizes(model: nn.Module) -> list[int]:
    """Elements of each of `model`'s units as the wrap policy cuts it (the root unit first), trained and frozen
    parameters alike."""
    return [sum(numel(p) for _, p in trained + frozen) for _, _, trained, frozen in split_units(model)]


def cold_units(total_params: int, largest_unit_params: int) -> list[int]:
    """Unit sizes for a model known by counts alone: as many blocks of `largest_unit_params` as `total_params`
    holds, the rest in the root unit (without a largest unit, the model is one unit)."""
    total, largest = int(total_params), int(largest_unit_params)
    blocks = total // largest if 0 < largest <= total else 0
    return [total - blocks * largest] + [largest] * blocks


class _Block(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, device="meta"))


def shape_model(sizes: list[int]) -> nn.Module:
    """A meta model the wrap policy cuts into units of `sizes` (the root's first): what the plan is made of."""
    model = nn.Module()
    if sizes[0]:  # an empty root makes no unit
        model.weight = nn.Parameter(torch.empty(sizes[0], device="meta"))
    model.blocks = nn.ModuleList(_Block(n) for n in sizes[1:])
    return model


def model_states(sizes: list[int], *, stage: int, world_size: int, offload_optimizer: str,
                 offload_param: str = "none", zero_init: bool = False) -> dict[str, int]:
    """Bytes one of `world_size` ranks holds for a placement of a model of unit `sizes`:

    - "host": the larger of what the script builds before `initialize` (the whole model in fp32, or with zero_init
      this rank's slices of it, zero.Init's InitStore) and the least host budget a step runs in
      (budgets.host_minimum: the optimizer's fp32 master, moments and gradient with offload_optimizer cpu, the
      compute-dtype parameter shards with offload_param cpu, the gradients' staging): `initialize` moves the model
      into the tiers a unit at a time, freeing what it took;
    - "device": the least device budget (budgets.device_minimum: segments homed there, stage 3's gathered units
      and their gradients, the reduction's scratch) and, below stage 3, the resident parameters' full buffers and
      the gradients autograd leaves beside them;
    - "gathered": of that, stage 3's gathered units and their gradients (DeepSpeed's largest_layer_memory).
    """
    zo = {"stage": stage, "offload_optimizer": {"device": offload_optimizer}}
    if stage == 3:
        zo["offload_param"] = {"device": offload_param}
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": zo},
                      world_size=world_size)
    dtype = compute_dtype(cfg)
    model = shape_model(sizes)
    ranks = SimpleNamespace(world_size=world_size, rank=0)  # every rank's shard is rank 0's size
    plan = plan_units(model, param_groups_from(model, None, None, cfg), ranks)
    flats = [flat for flat, _ in plan]
    # Without a device budget the engine holds the root unit gathered between its uses (budgets.parks_root).
    device = device_minimum(cfg, plan, model, dtype, charge=lambda nbytes: device_charge(nbytes, torch.device("cuda")),
                            parked=False)
    resident = 0 if stage == 3 else sum(dtype.itemsize * (flat.padded_numel + flat.numel) for flat in flats)
    built = sum(-(-n // world_size) for n in sizes) if zero_init else sum(sizes)
    return {"host": max(BUILD_BYTES * built, sum(host_minimum(cfg, flats, dtype).values())),
            "device": sum(device.values()) + resident,
            "gathered": device["gathered units"] + device["unit gradients"]}
