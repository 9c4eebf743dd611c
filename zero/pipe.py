"""DeepSpeed's `deepspeed.pipe` (PipelineModule, LayerSpec, TiedLayerSpec): pipeline parallelism is not
implemented, so importing this module raises UnsupportedFeatureError saying what to use instead."""
from .unsupported import PIPELINE_INSTEAD, UnsupportedFeatureError

raise UnsupportedFeatureError("deepspeed.pipe (PipelineModule, LayerSpec, TiedLayerSpec: pipeline parallelism)",
                              PIPELINE_INSTEAD)
