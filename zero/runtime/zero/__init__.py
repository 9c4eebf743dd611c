"""DeepSpeed's `deepspeed.runtime.zero`: `GatheredParameters`, `Init` and `partition_parameters`, which are
`zero.zero`'s, and `offload_config`'s enums."""
from . import offload_config, partition_parameters
from .partition_parameters import GatheredParameters, Init, ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "offload_config", "partition_parameters"]
