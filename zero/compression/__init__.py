"""DeepSpeed's `deepspeed.compression`: the module helpers scripts import from it (LoRA code does, to reach and
replace submodules by dotted name); compression itself (quantization-aware training, pruning) is not here:
`compress`'s entry points raise UnsupportedFeatureError when called."""
from . import compress, helper

__all__ = ["compress", "helper"]
