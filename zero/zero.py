"""DeepSpeed's `deepspeed.zero` namespace, for scripts that `import zero as deepspeed`: `deepspeed.zero.Init`,
`deepspeed.zero.GatheredParameters` and the parameter status their readers compare against."""
from .params.ds_param import ZeroParamStatus
from .params.gathered import GatheredParameters
from .params.init_partition import Init

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]
