"""DeepSpeed's `deepspeed.compression.compress`: DeepSpeed Compression (quantization-aware training, pruning,
layer reduction) is not implemented; its entry points import, and raise UnsupportedFeatureError when called."""
from ..integrations.unsupported import COMPRESSION_INSTEAD, stand_ins_getattr

__getattr__ = stand_ins_getattr(__name__, "deepspeed.compression.compress", dict.fromkeys(
    ("init_compression", "redundancy_clean", "student_initialization"), COMPRESSION_INSTEAD))
