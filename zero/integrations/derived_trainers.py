"""zero_trainer(cls): trainers built on the Hugging Face Trainer (TRL's SFTTrainer, DPOTrainer, a user's own)
training with zero-tiering's engine, as ZeroTrainer does the Trainer; a reference model they are given (DPO's) is
partitioned into the tiers for inference before cls prepares it."""
from __future__ import annotations

import inspect
import json
import os
from collections.abc import Mapping
from typing import Any

from torch import nn
from transformers import Trainer, TrainingArguments

from ..inference import init_inference
from .hf_trainer import ZeroTrainer, _read_json


def zero_trainer(cls: type[Trainer]) -> type[Trainer]:
    """`cls` (a subclass of transformers' Trainer: TRL's SFTTrainer, DPOTrainer, a user's own) training with our
    engine: a subclass of both whose methods resolve cls's own overrides first, then ZeroTrainer's, then Trainer's
    (`ZeroSFTTrainer.__mro__`: ZeroSFTTrainer, SFTTrainer, ..., ZeroTrainer, Trainer), so that what cls adds
    around the Trainer's steps (TRL's training_step context, its loss, its logs and model card) runs and reaches
    the engine through ZeroTrainer. It takes cls's arguments plus `zero_config=` and `zero_weights=` as
    ZeroTrainer does (cls's own TrainingArguments subclass, e.g. SFTConfig, with `zero_config=` beside it)."""
    if issubclass(cls, ZeroTrainer):
        return cls
    if not issubclass(cls, Trainer):
        raise TypeError(f"zero_trainer({cls.__name__}): a subclass of transformers.Trainer")

    def __init__(self, *args: Any, zero_config: str | os.PathLike | Mapping | None = None,
                 zero_weights: str | os.PathLike | None = None, **kwargs: Any) -> None:
        self._zero_arguments = (zero_config, zero_weights)  # cls's __init__ calls Trainer's without them
        given = inspect.signature(cls.__init__).bind_partial(self, *args, **kwargs).arguments
        reference = given.get("ref_model")
        if isinstance(reference, nn.Module):  # partitioned before cls prepares it: never whole on the device
            if getattr(given.get("args"), "sync_ref_model", False):
                raise ValueError(f"{cls.__name__}: sync_ref_model=True writes the policy's weights into the "
                                 "reference model, whose weights zero-tiering keeps partitioned: not supported")
            source = zero_config if zero_config is not None else getattr(given.get("args"), "zero_config", None)
            self.reference_engine = init_inference(reference, reference_config(source, given.get("args")))
        try:
            cls.__init__(self, *args, **kwargs)
        except BaseException:
            if getattr(self, "reference_engine", None) is not None:  # its buffers and nvme file go with the error
                self.reference_engine.close()
            raise

    return type(f"Zero{cls.__name__}", (cls, ZeroTrainer),
                {"__init__": __init__, "__module__": __name__, "__doc__": f"{cls.__name__} on zero-tiering's engine "
                 "(zero.integrations.zero_trainer)."})


def reference_config(source: str | os.PathLike | Mapping | None, args: TrainingArguments | None) -> dict:
    """The inference config of a reference model (a DPO trainer's): stage 3, its weights where the training config
    puts parameters (`offload_param`, in host memory without one), the arguments' compute dtype, the config's aio."""
    if source is None:
        raise ValueError("zero_trainer needs a DeepSpeed-format config: zero_config='ds_config.json'")
    raw = _read_json(json.loads(source) if isinstance(source, str) and source.lstrip().startswith("{") else source)
    offload = dict(raw.get("zero_optimization", {}).get("offload_param") or {"device": "cpu"})
    if offload.get("device") in (None, "none"):
        offload["device"] = "cpu"
    config = {"train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 3, "offload_param": offload, "stage3_param_persistence_threshold": 0},
              "bf16": {"enabled": bool(getattr(args, "bf16", False))},
              "fp16": {"enabled": bool(getattr(args, "fp16", False))}}
    if "aio" in raw:
        config["aio"] = raw["aio"]
    return config
