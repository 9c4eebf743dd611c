"""DeepSpeed's `deepspeed.moe`: mixture of experts with expert parallelism is not implemented. `layer.MoE` imports
as a stand-in that raises UnsupportedFeatureError when built; `utils`' helpers work for models without MoE layers
(scripts call them unconditionally) and raise where they meet an expert parameter."""
from . import layer, utils

__all__ = ["layer", "utils"]
