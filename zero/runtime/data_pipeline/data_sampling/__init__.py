"""DeepSpeed's `deepspeed.runtime.data_pipeline.data_sampling` (curriculum data sampling, variable batch size):
`variable_batch_size_and_lr`'s stand-ins."""
from . import variable_batch_size_and_lr

__all__ = ["variable_batch_size_and_lr"]
