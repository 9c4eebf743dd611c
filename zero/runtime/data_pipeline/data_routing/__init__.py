"""DeepSpeed's `deepspeed.runtime.data_pipeline.data_routing` (random-LTD): `helper`'s stand-ins."""
from . import helper

__all__ = ["helper"]
