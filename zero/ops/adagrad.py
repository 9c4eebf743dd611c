"""DeepSpeed's `deepspeed.ops.adagrad`: Adagrad is not implemented; `DeepSpeedCPUAdagrad` raises
UnsupportedFeatureError, on import by name too."""
from ..unsupported import ADAM_INSTEAD, raising_getattr

__getattr__ = raising_getattr(__name__, "deepspeed.ops.adagrad", {"DeepSpeedCPUAdagrad": ADAM_INSTEAD})
