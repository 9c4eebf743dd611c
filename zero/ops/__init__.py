"""DeepSpeed's `deepspeed.ops`, for scripts that import optimizers from it: `adam.DeepSpeedCPUAdam` is zero-tiering's
CPU-Adam under DeepSpeed's signature; DeepSpeed's other optimizers, fused kernels, `op_builder`'s builders and
`sparse_attention` raise UnsupportedFeatureError naming them (see zero/integrations/unsupported.py)."""
from ..integrations.unsupported import FUSED_LAYERS_INSTEAD, stand_ins_getattr
from . import adagrad, adam, lamb, lion, op_builder, sparse_attention

__all__ = ["adagrad", "adam", "lamb", "lion", "op_builder", "sparse_attention"]

__getattr__ = stand_ins_getattr(__name__, "deepspeed.ops", {"DeepSpeedTransformerLayer": FUSED_LAYERS_INSTEAD,
                                                          "DeepSpeedTransformerConfig": FUSED_LAYERS_INSTEAD})
