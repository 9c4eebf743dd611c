"""DeepSpeed's `deepspeed.runtime.zero`: `GatheredParameters`, `Init` and `partition_parameters`, which are
`zero.zero`'s, `offload_config`'s enums, and the memory estimators of `stage_1_and_2` and `stage3`."""
from . import offload_config, partition_parameters, stage3, stage_1_and_2
from .partition_parameters import GatheredParameters, Init, ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "offload_config", "partition_parameters", "stage3",
           "stage_1_and_2"]
