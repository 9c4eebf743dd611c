"""Inference from the tiers: `init_inference(model, config, weights=...)` returns a module whose forward and
`generate()` stream the weights from host memory or nvme unit by unit (engine.py); `python -m zero.inference`
generates from a saved model (__main__.py)."""
from .engine import InferenceEngine, init_inference

__all__ = ["InferenceEngine", "init_inference"]
