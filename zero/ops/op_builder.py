"""DeepSpeed's `deepspeed.ops.op_builder`: zero-tiering compiles none of DeepSpeed's ops. Its builders (what a
script asks for the async I/O handle or a kernel through, e.g. `AsyncIOBuilder().load()`) import, and raise
UnsupportedFeatureError when built."""
from ..integrations.unsupported import KERNEL_BUILDS_INSTEAD, stand_ins_getattr

BUILDERS = (
    "OpBuilder", "AsyncIOBuilder", "GDSBuilder", "CPUAdamBuilder", "CPUAdagradBuilder", "CPULionBuilder",
    "FusedAdamBuilder", "FusedLambBuilder", "FusedLionBuilder", "TransformerBuilder", "StochasticTransformerBuilder",
    "InferenceBuilder", "InferenceCoreBuilder", "InferenceCutlassBuilder", "SpatialInferenceBuilder",
    "RaggedOpsBuilder", "RaggedUtilsBuilder", "QuantizerBuilder", "FPQuantizerBuilder", "SparseAttnBuilder",
    "EvoformerAttnBuilder", "RandomLTDBuilder", "PinMemoryBuilder", "UtilsBuilder", "DeepCompileBuilder",
)
"""DeepSpeed's builders (op_builder/*.py)."""

__getattr__ = stand_ins_getattr(__name__, "deepspeed.ops.op_builder", dict.fromkeys(BUILDERS, KERNEL_BUILDS_INSTEAD))
