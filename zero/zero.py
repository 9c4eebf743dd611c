"""DeepSpeed's `deepspeed.zero` namespace, for scripts that `import zero as deepspeed`: `deepspeed.zero.Init`,
`deepspeed.zero.GatheredParameters`, the parameter status their readers compare against, and the external-parameter
registration Hugging Face models call (params/external.py)."""
from .params.ds_param import ZeroParamStatus
from .params.external import register_external_parameter, unregister_external_parameter
from .params.gathered import GatheredParameters
from .params.init_partition import Init

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]
