"""DeepSpeed's `deepspeed.runtime` paths that scripts import names from (`runtime.zero.partition_parameters`)."""
from . import zero

__all__ = ["zero"]
