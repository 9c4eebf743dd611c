"""UnsupportedFeatureError: a DeepSpeed feature a script reaches for (a class, an argument, a module) that
zero-tiering does not implement. Code written for DeepSpeed runs with `import zero as deepspeed`, so a missing
piece must fail where the script asks for it, by DeepSpeed's name, with what to use instead: never an ImportError
that reads like a broken install, never a silent stand-in that trains something else.

The texts below say what zero-tiering offers in each feature's place; the modules named after DeepSpeed's
(`zero.ops.*`, `zero.pipe`, `zero.moe`) raise with them.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NoReturn


class UnsupportedFeatureError(NotImplementedError):
    """`feature` (DeepSpeed's name for it) is not implemented; `instead` says what zero-tiering offers."""

    def __init__(self, feature: str, instead: str):
        self.feature, self.instead = feature, instead
        super().__init__(f"{feature} is not implemented in zero-tiering; instead: {instead}")


def raising_getattr(module: str, deepspeed_module: str,
                    instead: Mapping[str, str]) -> Callable[[str], NoReturn]:
    """A module-level `__getattr__` for `module` (DeepSpeed's `deepspeed_module`): each name in `instead` raises
    UnsupportedFeatureError, so `from module import Name` fails with that message rather than ImportError
    (Python turns only an AttributeError into one); any other name is the usual AttributeError."""

    def __getattr__(name: str) -> NoReturn:
        if name in instead:
            raise UnsupportedFeatureError(f"{deepspeed_module}.{name}", instead[name])
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


ADAM_INSTEAD = (
    "pass torch.optim.AdamW (or zero.ops.adam.DeepSpeedCPUAdam) to zero.initialize(optimizer=...), or set the "
    'config\'s optimizer section, e.g. "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": '
    '0.01}}; zero-tiering steps Adam/AdamW itself (with zero_optimization.offload_optimizer.device "cpu" or '
    '"nvme", on its CPU-Adam)'
)
"""For DeepSpeed's optimizers other than Adam/AdamW, and its GPU-fused Adam."""

PIPELINE_INSTEAD = (
    "ZeRO-3 data parallelism with offload, which fits a model that pipeline parallelism would split across GPUs: "
    "build the layers as a plain nn.Module (e.g. torch.nn.Sequential of what the PipelineModule's LayerSpecs "
    'build), pass it to zero.initialize with zero_optimization.stage 3 and offload_param / offload_optimizer '
    'device "cpu" or "nvme", and train with loss = engine(batch); engine.backward(loss); engine.step() in place '
    "of engine.train_batch()"
)
"""For deepspeed.pipe and the pipeline engine."""

MOE_INSTEAD = (
    "the experts as ordinary modules (e.g. a Hugging Face Mixtral or Qwen-MoE model) under ZeRO-3 "
    '(zero_optimization.stage 3, offload_param "cpu" or "nvme"), which shards every expert\'s parameters across '
    "ranks like any others; there is no expert parallelism (no all-to-all): each rank runs the experts its "
    "tokens are routed to"
)
"""For deepspeed.moe (the MoE layer and its helpers)."""

FUSED_LAYERS_INSTEAD = "the model's own layers (e.g. Hugging Face's); DeepSpeed's fused transformer kernels are absent"
"""For DeepSpeed's fused transformer layer and its config."""

TOP_LEVEL_INSTEAD = {
    "pipe": PIPELINE_INSTEAD,
    "moe": MOE_INSTEAD,
    "PipelineModule": PIPELINE_INSTEAD,
    "PipelineEngine": PIPELINE_INSTEAD,
    "DeepSpeedTransformerLayer": FUSED_LAYERS_INSTEAD,
    "DeepSpeedTransformerConfig": FUSED_LAYERS_INSTEAD,
    "DeepSpeedHybridEngine": "zero.initialize to train and zero.init_inference to generate",
}
"""DeepSpeed's top-level names (`deepspeed.X`) for features zero-tiering lacks, for `zero`'s module
`__getattr__`: `raising_getattr("zero", "deepspeed", TOP_LEVEL_INSTEAD)`."""
