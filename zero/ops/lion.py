"""DeepSpeed's `deepspeed.ops.lion`: Lion is not implemented; `DeepSpeedCPULion` and `FusedLion` raise
UnsupportedFeatureError, on import by name too."""
from ..integrations.unsupported import ADAM_INSTEAD, stand_ins_getattr

__getattr__ = stand_ins_getattr(__name__, "deepspeed.ops.lion", {"DeepSpeedCPULion": ADAM_INSTEAD,
                                                               "FusedLion": ADAM_INSTEAD})
