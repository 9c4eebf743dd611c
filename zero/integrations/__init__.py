"""zero-tiering's engine inside other training libraries.

`ZeroTrainer` / `ZeroTrainingArguments` (zero/integrations/hf_trainer.py): the Hugging Face Trainer training
with our engine where it would use DeepSpeed; `save_safetensors` (weights.py): a live engine's consolidated
weights, streamed unit by unit. Needs transformers and accelerate: `pip install 'zero-tiering[hf]'`.
"""
try:
    import accelerate  # noqa: F401  (the Trainer needs it; say so here rather than deep inside transformers)
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"zero.integrations needs transformers and accelerate ({exc}): "
                      "pip install 'zero-tiering[hf]'") from exc

from .hf_trainer import EngineOptimizer, EngineScheduler, ZeroTrainer, ZeroTrainingArguments
from .weights import save_safetensors

__all__ = ["EngineOptimizer", "EngineScheduler", "ZeroTrainer", "ZeroTrainingArguments", "save_safetensors"]
