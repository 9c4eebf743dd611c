"""Inference from the tiers: `init_inference(model, config, weights=...)` returns a module whose forward and
`generate()` stream the weights from host memory or nvme unit by unit (engine.py); `python -m zero.inference`
generates from a saved model (__main__.py). A script calls it with DeepSpeed's arguments (deepspeed_config.py);
DeepSpeed-FastGen's names (`deepspeed.inference`'s v2 engine) import, and raise UnsupportedFeatureError when built."""
from ..integrations.unsupported import stand_ins_getattr
from .engine import InferenceEngine, init_inference

__all__ = ["InferenceEngine", "init_inference"]

__getattr__ = stand_ins_getattr(__name__, "deepspeed.inference", dict.fromkeys(
    ("RaggedInferenceEngineConfig", "DeepSpeedTPConfig", "InferenceEngineV2", "build_hf_engine",
     "build_engine_from_ds_checkpoint"),
    "zero.init_inference(model, dtype=...): the model's own forward and generate(), one rank per model, its weights "
    "streamed from host memory or nvme; DeepSpeed-FastGen's ragged batching engine is absent"))
