"""DeepSpeed's `deepspeed.ops.lion`: Lion is not implemented; `DeepSpeedCPULion` and `FusedLion` raise
UnsupportedFeatureError, on import by name too."""
from ..unsupported import ADAM_INSTEAD, raising_getattr

__getattr__ = raising_getattr(__name__, "deepspeed.ops.lion", {"DeepSpeedCPULion": ADAM_INSTEAD,
                                                               "FusedLion": ADAM_INSTEAD})
