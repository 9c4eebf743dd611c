"""DeepSpeed's `deepspeed.module_inject`: kernel injection and automatic tensor parallelism (AutoTP) are not
implemented. Its functions, policies and layers import, and raise UnsupportedFeatureError when called or built."""
from .integrations.unsupported import INJECTION_INSTEAD, TENSOR_PARALLEL_INSTEAD, stand_ins_getattr

__getattr__ = stand_ins_getattr(__name__, "deepspeed.module_inject", {
    **dict.fromkeys(("replace_transformer_layer", "revert_transformer_layer", "ReplaceWithTensorSlicing",
                     "GroupQuantizer", "generic_injection", "quantize_transformer_layer", "HFBertLayerPolicy",
                     "DSPolicy"), INJECTION_INSTEAD),
    **dict.fromkeys(("LinearAllreduce", "LinearLayer", "EmbeddingLayer", "Normalize", "set_autotp_mode",
                     "SubParamLinearLayer", "SubParamLinearAllreduce", "TPLayerSpec", "AutoTPConfig", "PartitionType",
                     "AutoTPPresets", "merge_autotp_configs"), TENSOR_PARALLEL_INSTEAD),
})
