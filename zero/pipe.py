"""DeepSpeed's `deepspeed.pipe`: pipeline parallelism is not implemented. Its names import (a script may import them
and take another branch) as stand-ins that raise UnsupportedFeatureError, saying what to use instead, when built."""
from .integrations.unsupported import PIPELINE_INSTEAD, stand_ins_getattr

__getattr__ = stand_ins_getattr(__name__, "deepspeed.pipe", dict.fromkeys(
    ("PipelineModule", "LayerSpec", "TiedLayerSpec", "PipelineEngine", "ProcessTopology", "PipeDataParallelTopology",
     "PipeModelDataParallelTopology"), PIPELINE_INSTEAD))
