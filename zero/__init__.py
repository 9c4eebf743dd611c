"""zero: the training face of zero-tiering: config, engine, ZeRO partitioner, CPU-Adam, precision, checkpoints."""
from .cpu_adam import CPUAdam
from .builder import initialize

__all__ = ["CPUAdam", "initialize"]
