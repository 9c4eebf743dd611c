"""DeepSpeed's `deepspeed.sequence`: sequence parallelism (Ulysses, FPDT, AutoSP) is not implemented; `layer`'s
`DistributedAttention` and this package's names import, and raise UnsupportedFeatureError when built or called."""
from ..integrations.unsupported import SEQUENCE_PARALLEL_INSTEAD, stand_ins_getattr
from . import layer

__all__ = ["layer"]

__getattr__ = stand_ins_getattr(__name__, "deepspeed.sequence", dict.fromkeys((
    "auto_wrap_model_for_sp", "detect_model_sp_info", "SPModelInfo", "UlyssesSPViTAttention"),
    SEQUENCE_PARALLEL_INSTEAD))
