"""DeepSpeed's `deepspeed.runtime.data_pipeline` (Data Efficiency: random-LTD, curriculum learning, variable batch
size) is not implemented; the helpers scripts import from `data_routing.helper` and `data_sampling` raise
UnsupportedFeatureError when called."""
from . import data_routing, data_sampling

__all__ = ["data_routing", "data_sampling"]
