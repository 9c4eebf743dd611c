"""zero-tiering's engine inside other training libraries, and the DeepSpeed surface it stands in for.

`ZeroTrainer` / `ZeroTrainingArguments` (hf_trainer.py) / `zero_trainer` (derived_trainers.py): the Hugging Face
Trainer, and trainers built on it (TRL's), training with our engine where they would use DeepSpeed;
`save_safetensors` (weights.py): a live engine's consolidated weights, streamed unit by unit. These need
transformers and accelerate (`pip install 'zero-tiering[hf]'`) and are imported on first use, so that `import zero`
(which reads `unsupported.py`, and `deepspeed_alias.py` under the launcher) never pulls them in.
"""
from __future__ import annotations

import importlib

LAZY = {"EngineOptimizer": "engine_views", "EngineScheduler": "engine_views", "ZeroTrainer": "hf_trainer",
        "ZeroTrainingArguments": "hf_trainer", "zero_trainer": "derived_trainers", "save_safetensors": "weights"}

__all__ = sorted(LAZY)


def __getattr__(name: str):
    if name not in LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        import accelerate  # noqa: F401  (the Trainer needs it; say so here rather than deep inside transformers)
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(f"zero.integrations.{name} needs transformers and accelerate ({exc}): "
                          "pip install 'zero-tiering[hf]'") from exc
    return getattr(importlib.import_module(f".{LAZY[name]}", __name__), name)
