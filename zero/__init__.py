"""zero: the training face of zero-tiering: config, engine, ZeRO placements, CPU-Adam, precision, checkpoints.

Layout: `initialize` (the recipe), `engine` (the training loop's calls), `budgets` (the swap manager's
configuration), `counters`, `comm` (collectives), `export` (the consolidated fp32 export command); packages
`config/` (DeepSpeed-format JSON), `params/` (units and their placements), `optim/` (Adam, gradients,
schedules), `checkpoint/` (save, load, format), `inference/` (weights streamed for forward and generate),
`plan/` and `report/` (will it fit, is this machine ready) and `train/` (the main job: `python -m zero.train`).

A script written for DeepSpeed runs with `import zero as deepspeed`: `initialize`, `add_config_arguments`,
`init_distributed`, `zero.Init` and `zero.GatheredParameters` (module `zero.zero`), `utils`' safe_get_* and
safe_set_*, `checkpointing.checkpoint`, `ops.adam.DeepSpeedCPUAdam`, and `python -m zero.launch` for the `deepspeed` launcher. What it does
not implement (`deepspeed.pipe`, `deepspeed.moe`, `PipelineModule`, fused kernels) raises UnsupportedFeatureError
naming it and what to use instead.
"""
from . import checkpointing, ops, utils, zero
from .arguments import add_config_arguments
from .comm import init_distributed
from .inference import init_inference
from .initialize import initialize
from .optim.cpu_adam import CPUAdam
from .unsupported import TOP_LEVEL_INSTEAD, raising_getattr

__all__ = ["CPUAdam", "add_config_arguments", "checkpointing", "init_distributed", "init_inference", "initialize", "ops",
           "utils", "zero"]

__getattr__ = raising_getattr("zero", "deepspeed", TOP_LEVEL_INSTEAD)
