"""DeepSpeed's `deepspeed.ops.sparse_attention`: block-sparse attention is not implemented (the config's
`sparse_attention` section is refused too). Its sparsity configs, layers and utilities import, and raise
UnsupportedFeatureError when built."""
from ..integrations.unsupported import SPARSE_ATTENTION_INSTEAD, stand_ins_getattr

__getattr__ = stand_ins_getattr(__name__, "deepspeed.ops.sparse_attention", dict.fromkeys((
    "SparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig", "BigBirdSparsityConfig",
    "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig", "SparseSelfAttention", "BertSparseSelfAttention",
    "SparseAttentionUtils"), SPARSE_ATTENTION_INSTEAD))
