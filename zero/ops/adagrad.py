"""DeepSpeed's `deepspeed.ops.adagrad`: Adagrad is not implemented; `DeepSpeedCPUAdagrad` raises
UnsupportedFeatureError, on import by name too."""
from ..integrations.unsupported import ADAM_INSTEAD, stand_ins_getattr

__getattr__ = stand_ins_getattr(__name__, "deepspeed.ops.adagrad", {"DeepSpeedCPUAdagrad": ADAM_INSTEAD})
