"""DeepSpeed's `deepspeed.sequence.layer`: `DistributedAttention` (Ulysses) imports, and raises
UnsupportedFeatureError when built."""
from ..integrations.unsupported import SEQUENCE_PARALLEL_INSTEAD, stand_ins_getattr

__getattr__ = stand_ins_getattr(__name__, "deepspeed.sequence.layer",
                                {"DistributedAttention": SEQUENCE_PARALLEL_INSTEAD})
