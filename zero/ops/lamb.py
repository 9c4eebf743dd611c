"""DeepSpeed's `deepspeed.ops.lamb`: LAMB is not implemented; `FusedLamb` raises UnsupportedFeatureError, on import
by name too."""
from ..unsupported import ADAM_INSTEAD, raising_getattr

__getattr__ = raising_getattr(__name__, "deepspeed.ops.lamb", {"FusedLamb": ADAM_INSTEAD})
