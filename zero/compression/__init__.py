"""DeepSpeed's `deepspeed.compression`: the module helpers scripts import from it (LoRA code does, to reach and
replace submodules by dotted name); compression itself (quantization-aware training, pruning) is not here."""
from . import helper

__all__ = ["helper"]
