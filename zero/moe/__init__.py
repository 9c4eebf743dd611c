"""DeepSpeed's `deepspeed.moe` (`deepspeed.moe.layer.MoE` and its helpers): mixture of experts with expert
parallelism is not implemented, so importing this package, or anything under it, raises UnsupportedFeatureError
saying what to use instead."""
from ..unsupported import MOE_INSTEAD, UnsupportedFeatureError

raise UnsupportedFeatureError("deepspeed.moe (MoE layers with expert parallelism)", MOE_INSTEAD)
