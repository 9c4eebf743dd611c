"""zero: the training face of zero-tiering: config, engine, ZeRO placements, CPU-Adam, precision, checkpoints.

Layout: `initialize` (the recipe), `engine` (the training loop's calls), `budgets` (the swap manager's
configuration), `counters`, `comm` (collectives), `export` (the consolidated fp32 export command); packages
`config/` (DeepSpeed-format JSON), `params/` (units and their placements), `optim/` (Adam, gradients,
schedules), `checkpoint/` (save, load, format), `inference/` (weights streamed for forward and generate),
`plan/` and `report/` (will it fit, is this machine ready) and `train/` (the main job: `python -m zero.train`).

A script written for DeepSpeed runs with `import zero as deepspeed`: `initialize`, `add_config_arguments`,
`init_distributed`, `zero.Init` and `zero.GatheredParameters` (module `zero.zero`, and `runtime.zero.
partition_parameters`), `utils`' safe_get_* and safe_set_*, logger, leaf modules and RepeatingLoader,
`runtime.utils`' set_random_seed and see_memory_usage, `DeepSpeedConfig`, `checkpointing.checkpoint`,
`ops.adam.DeepSpeedCPUAdam` and `FusedAdam`, `accelerator.get_accelerator`, `comm`'s functions, `compression.helper`,
`moe.utils`' helpers for dense models, and `python -m zero.launch` for the `deepspeed` launcher. What it does not
implement (pipeline, tensor and sequence parallelism, MoE layers, fused kernels and their builders, kernel injection,
sparse attention, Data Efficiency, Compression) imports as a stand-in that raises UnsupportedFeatureError, naming it
and what to use instead, when the script builds or calls it.
"""
from . import (accelerator, checkpointing, comm, compression, module_inject, moe, ops, pipe, runtime, sequence, utils,
               zero)
from .accelerator import get_accelerator
from .cli.arguments import add_config_arguments
from .comm import init_distributed
from .inference import init_inference
from .initialize import initialize
from .optim.cpu_adam import CPUAdam
from .runtime.config import DeepSpeedConfig
from .utils import log_dist, logger
from .integrations.unsupported import TOP_LEVEL_INSTEAD, stand_ins_getattr

__version__ = "0.1.0"

__all__ = ["CPUAdam", "DeepSpeedConfig", "accelerator", "add_config_arguments", "checkpointing", "comm", "compression",
           "get_accelerator", "init_distributed", "init_inference", "initialize", "log_dist", "logger",
           "module_inject", "moe", "ops", "pipe", "runtime", "sequence", "utils", "zero"]

__getattr__ = stand_ins_getattr("zero", "deepspeed", TOP_LEVEL_INSTEAD)
