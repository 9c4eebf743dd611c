"""DeepSpeed's `deepspeed.ops`, for scripts that import optimizers from it: `adam.DeepSpeedCPUAdam` is zero-tiering's
CPU-Adam under DeepSpeed's signature; DeepSpeed's other optimizers and fused kernels raise UnsupportedFeatureError
naming them (see zero/integrations/unsupported.py)."""
from ..integrations.unsupported import FUSED_LAYERS_INSTEAD, stand_ins_getattr
from . import adagrad, adam, lamb, lion

__all__ = ["adagrad", "adam", "lamb", "lion"]

__getattr__ = stand_ins_getattr(__name__, "deepspeed.ops", {"DeepSpeedTransformerLayer": FUSED_LAYERS_INSTEAD,
                                                          "DeepSpeedTransformerConfig": FUSED_LAYERS_INSTEAD})
