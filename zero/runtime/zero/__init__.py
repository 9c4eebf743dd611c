"""DeepSpeed's `deepspeed.runtime.zero`: `GatheredParameters`, `Init` and `partition_parameters`, which are
`zero.zero`'s."""
from . import partition_parameters
from .partition_parameters import GatheredParameters, Init, ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "partition_parameters"]
