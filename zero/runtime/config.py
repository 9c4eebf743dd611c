"""DeepSpeed's `deepspeed.DeepSpeedConfig` (`deepspeed.runtime.config`): a ds_config read outside an engine, as
scripts read one to size a layer by the micro-batch or to learn the precision. Our loader reads it (the world size
is the process group's, else WORLD_SIZE's), so a key zero-tiering refuses is refused here too; the attributes are
DeepSpeed's names for what the config sets (any other is an AttributeError)."""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..comm import DataParallel
from ..config import load_config
from ..integrations.unsupported import TENSOR_PARALLEL_INSTEAD, UnsupportedFeatureError


class DeepSpeedConfig:
    """`config`: a path or a dict. `mpu` and `mesh_device` (model parallelism) must be None."""

    def __init__(self, config: str | os.PathLike | Mapping[str, Any], mpu: Any = None, mesh_device: Any = None):
        for name, value in (("mpu", mpu), ("mesh_device", mesh_device)):
            if value is not None:
                raise UnsupportedFeatureError(f"deepspeed.DeepSpeedConfig({name}=...)", TENSOR_PARALLEL_INSTEAD)
        self.world_size = DataParallel.world_size_to_join()
        cfg = load_config(config, world_size=self.world_size)
        self.train_batch_size = cfg.train_batch_size
        self.train_micro_batch_size_per_gpu = cfg.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self.gradient_clipping = cfg.gradient_clipping
        self.fp16_enabled = cfg.fp16.enabled
        self.bfloat16_enabled = cfg.bf16.enabled
        self.zero_optimization_stage = cfg.zero_optimization.stage
        self.zero_enabled = cfg.zero_optimization.stage > 0
        self.sparse_attention = None
        """Always None: the loader refuses a sparse_attention section (DeepSpeed's is None without one)."""
