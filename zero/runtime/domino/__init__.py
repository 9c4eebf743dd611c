"""DeepSpeed's `deepspeed.runtime.domino` (Domino: tensor parallelism overlapping its communication) is not
implemented; `transformer`'s classes import, and raise UnsupportedFeatureError when built."""
from . import transformer

__all__ = ["transformer"]
