"""DeepSpeed's `deepspeed.moe.layer`: `MoE` imports, and raises UnsupportedFeatureError when built."""
from ..integrations.unsupported import MOE_INSTEAD, stand_ins_getattr

__getattr__ = stand_ins_getattr(__name__, "deepspeed.moe.layer", {"MoE": MOE_INSTEAD})
