"""zero: the training face of zero-tiering: config, engine, ZeRO placements, CPU-Adam, precision, checkpoints.

Layout: `initialize` (the recipe), `engine` (the training loop's calls), `budgets` (the swap manager's
configuration), `counters`, `comm` (collectives), `export` (the consolidated fp32 export command); packages
`config/` (DeepSpeed-format JSON), `params/` (units and their placements), `optim/` (Adam, gradients,
schedules), `checkpoint/` (save, load, format), `inference/` (weights streamed for forward and generate),
`plan/` and `report/` (will it fit, is this machine ready) and `train/` (the main job: `python -m zero.train`).
"""
from .inference import init_inference
from .initialize import initialize
from .optim.cpu_adam import CPUAdam

__all__ = ["CPUAdam", "init_inference", "initialize"]
