"""DeepSpeed's `deepspeed.runtime.domino.transformer`: Domino's tensor-parallel transformer imports, and raises
UnsupportedFeatureError when built."""
from ...integrations.unsupported import TENSOR_PARALLEL_INSTEAD, stand_ins_getattr

__getattr__ = stand_ins_getattr(__name__, "deepspeed.runtime.domino.transformer", dict.fromkeys(
    ("DominoTransformer", "DominoTransformerLayer", "DominoModule", "ShardedAttention", "CoreAttention"),
    TENSOR_PARALLEL_INSTEAD))
