"""DeepSpeed's `deepspeed.ops.lamb`: LAMB is not implemented; `FusedLamb` raises UnsupportedFeatureError, on import
by name too."""
from ..integrations.unsupported import ADAM_INSTEAD, stand_ins_getattr

__getattr__ = stand_ins_getattr(__name__, "deepspeed.ops.lamb", {"FusedLamb": ADAM_INSTEAD})
