"""InferenceEngine: a model whose weights live in the tiers (host memory or nvme) and stream to the device unit
by unit for each forward, as DeepSpeed's ZeRO-Inference does, with no optimizer state, no gradients and no fp32
masters.

`init_inference` builds it from a DeepSpeed-format config (stage 3, `offload_param` cpu or nvme, bf16/fp16 for
the compute dtype, the `aio` section) and, optionally, a safetensors checkpoint read unit by unit straight into
the tiers (a model built on meta never exists whole in host memory). Every forward, `generate()`'s included,
gathers each unit just before it runs and releases it after; the order of the first forward is the trace that
prefetch follows in the next ones.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tiering import SwapManager, check_room

from ..services.budgets import HOMES, compute_dtype, host_minimum, nvme_segments, swap_config
from ..comm import DataParallel, local_device
from ..config import Config, ConfigError, load_config
from ..initialize import check_host_budget, plan_units
from ..params.materialize import Materializer
from ..params.partitioned import PartitionedPlacement
from ..params.persistence import persistent_units
from ..params.pretrained import PretrainedWeights
from . import deepspeed_config

DEFAULT_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "stage3_param_persistence_threshold": 0},
}
"""Weights in host memory, fp32: what `init_inference(model)` does without a config."""


def init_inference(model: nn.Module, config: str | os.PathLike | Mapping | None = None, *,
                   weights: str | os.PathLike | None = None, **deepspeed_args: Any) -> InferenceEngine:
    """An InferenceEngine over `model` (built on meta, or with real values it takes over) with one rank's
    weights partitioned into the tiers `config` names; `weights`: a safetensors checkpoint (a save_pretrained
    directory, sharded or not, or our export) the weights are read from. DeepSpeed's arguments (`dtype=`,
    `mp_size=`, ..., or its inference config as `config`) are translated by deepspeed_config.py."""
    cfg, dtype, plan = _plan(model, deepspeed_config.ours(config, deepspeed_args, DEFAULT_CONFIG))
    zo = cfg.zero_optimization
    device = local_device()
    swap = SwapManager(swap_config(cfg, [flat for flat, _ in plan], dtype, optimizer=False))
    try:
        check_host_budget(cfg, [flat for flat, _ in plan], dtype, swap, optimizer=False)  # before any write
        if swap.store is not None:
            check_room(swap.store, nvme_segments(cfg, [flat for flat, _ in plan], dtype, optimizer=False))
        placement = PartitionedPlacement.build(
            model, plan, materialize=Materializer(model, PretrainedWeights(weights) if weights is not None else None),
            driver=None, param_home=HOMES[zo.offload_param.device], dtype=dtype, sub_group_size=0,
            persistent=persistent_units(zo, [flat for flat, _ in plan]), masters_are_params=False, swap=swap,
            dp=DataParallel(), device=device, gradients=None)
    except BaseException:
        swap.close()
        raise
    model.requires_grad_(False)
    return InferenceEngine(model, placement, swap, dtype, device).eval()  # no dropout: inference


def host_need(model: nn.Module, config: str | os.PathLike | Mapping | None = None) -> int:
    """The least host budget `init_inference` takes for `model` under `config` (budgets.host_minimum: with the
    weights on nvme, the largest shard): the plan alone, nothing built or written."""
    cfg, dtype, plan = _plan(model, config)
    model.requires_grad_(False)
    return sum(host_minimum(cfg, [flat for flat, _ in plan], dtype, optimizer=False).values())


def _plan(model: nn.Module, config: str | os.PathLike | Mapping | None) -> tuple[Config, torch.dtype, list]:
    """The config read, the compute dtype and the units planned (every weight as a trained one: the same units and
    names as training; the caller sets requires_grad back)."""
    cfg = load_config(config if config is not None else DEFAULT_CONFIG,
                      hidden_size=getattr(getattr(model, "config", None), "hidden_size", None))
    if cfg.zero_optimization.stage != 3:
        raise ConfigError("zero_optimization.stage", "inference streams partitioned weights: use stage 3",
                          value=cfg.zero_optimization.stage)
    model.requires_grad_(True)
    return cfg, compute_dtype(cfg), plan_units(model, [{"params": list(model.parameters())}], DataParallel())


class InferenceEngine(nn.Module):
    def __init__(self, module: nn.Module, placement: PartitionedPlacement, swap: SwapManager, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.module = module
        self.placement = placement
        self.swap = swap
        self.compute_dtype = dtype
        self.device = device
        self.config = getattr(module, "config", None)
        """The model's own (Hugging Face) config, as DeepSpeed's InferenceEngine.config: scripts read it from the
        engine (DeepSpeedExamples' text-generation prints its performance figures from it)."""
        # After each forward of the whole model (generate() calls it once a token): its fetches are one step
        # of the trace, which prefetch follows in the next forward.
        self._step_hook = module.register_forward_hook(lambda m, args, out: swap.end_step())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return self.module(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own generate() (a transformers model), every forward streaming the weights."""
        with torch.no_grad():
            return self.module.generate(*args, **kwargs)

    def close(self) -> None:
        """Free every tier's buffers and remove the nvme store's file."""
        self._step_hook.remove()
        self.placement.close()
        self.swap.close()
