"""UnsupportedFeatureError: a DeepSpeed feature a script reaches for (a class, an argument, a module) that
zero-tiering does not implement. Code written for DeepSpeed runs with `import zero as deepspeed`, so a missing
piece must fail where the script uses it, by DeepSpeed's name, with what to use instead: never at import (a script
imports what it may never use: a MoE helper, an optimizer for another branch), never an ImportError that reads
like a broken install, never a silent stand-in that trains something else.

The texts below say what zero-tiering offers in each feature's place; the modules named after DeepSpeed's
(`zero.ops.*`, `zero.pipe`, `zero.moe`) hand out stand-ins that raise with them when called or built.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NoReturn


class UnsupportedFeatureError(NotImplementedError):
    """`feature` (DeepSpeed's name for it) is not implemented; `instead` says what zero-tiering offers."""

    def __init__(self, feature: str, instead: str):
        self.feature, self.instead = feature, instead
        super().__init__(f"{feature} is not implemented in zero-tiering; instead: {instead}")


def stand_in(feature: str, instead: str, module: str) -> type:
    """What `feature` (DeepSpeed's dotted name) imports as from `module` (ours): a class that raises
    UnsupportedFeatureError when it is called or built (subclassing it is allowed; building the subclass raises)."""
    def __new__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        raise UnsupportedFeatureError(feature, instead)

    return type(feature.rsplit(".", 1)[-1], (), {
        "__new__": __new__, "__module__": module,
        "__doc__": f"DeepSpeed's {feature}, not implemented: building or calling it raises UnsupportedFeatureError."})


def stand_ins_getattr(module: str, deepspeed_module: str, instead: Mapping[str, str]) -> Callable[[str], type]:
    """A module-level `__getattr__` for `module` (DeepSpeed's `deepspeed_module`): each name in `instead` is a
    `stand_in`, made once, so `from module import Name` works and `Name(...)` raises UnsupportedFeatureError; any
    other name is the usual AttributeError (a typo stays Python's ImportError)."""
    made: dict[str, type] = {}

    def __getattr__(name: str) -> type:
        if name not in instead:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        if name not in made:
            made[name] = stand_in(f"{deepspeed_module}.{name}", instead[name], module)
        return made[name]

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
    'device "cpu" or "nvme", and train with loss = engine(batch); engine.backward(loss); engine.step(), or '
    "engine.train_batch(micro_batches, loss_fn=...) (each micro-batch the module's input, loss_fn(output, batch) "
    "its loss), in place of the pipeline engine's train_batch()"
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

TENSOR_PARALLEL_INSTEAD = (
    "ZeRO data parallelism: zero_optimization.stage 3 partitions every weight over the ranks, each rank running the "
    "whole model on its own batch; there is no tensor, model or sequence parallelism"
)
"""For tensor parallelism (init_inference's mp_size, AutoTP, Domino, an `mpu`)."""

INJECTION_INSTEAD = (
    "the model's own modules: zero.init_inference(model, dtype=...) streams their weights from host memory or nvme; "
    "there is no kernel injection or automatic tensor parallelism"
)
"""For deepspeed.module_inject and init_inference's kernel injection."""

KERNEL_BUILDS_INSTEAD = (
    "zero-tiering builds no DeepSpeed op: its NVMe I/O is tiering's (tiering.NvmeStore, O_DIRECT on the libaio or "
    "threads engine: the config's aio section and zero_tiering.engine), its CPU Adam zero.ops.adam.DeepSpeedCPUAdam"
)
"""For deepspeed.ops.op_builder."""

SPARSE_ATTENTION_INSTEAD = ("the model's own dense attention (e.g. torch.nn.functional.scaled_dot_product_attention); "
                            "DeepSpeed's block-sparse attention kernels are absent")
"""For deepspeed.ops.sparse_attention."""

SEQUENCE_PARALLEL_INSTEAD = (
    "each rank holding whole sequences: long ones fit with activation checkpointing and zero_tiering."
    'activation_offload "cpu" or "nvme"; there is no sequence (Ulysses) parallelism'
)
"""For deepspeed.sequence."""

DATA_EFFICIENCY_INSTEAD = ("the script's own data loading (a torch DataLoader); DeepSpeed Data Efficiency (random-LTD, "
                           "curriculum learning, variable batch size) is absent")
"""For deepspeed.runtime.data_pipeline."""

COMPRESSION_INSTEAD = ("the model as it is, or one quantized or pruned by another library before zero.initialize; "
                       "DeepSpeed Compression is absent")
"""For deepspeed.compression.compress."""

TOP_LEVEL_INSTEAD = {
    "PipelineModule": PIPELINE_INSTEAD,
    "PipelineEngine": PIPELINE_INSTEAD,
    "DeepSpeedTransformerLayer": FUSED_LAYERS_INSTEAD,
    "DeepSpeedTransformerConfig": FUSED_LAYERS_INSTEAD,
    "DeepSpeedHybridEngine": "zero.initialize to train and zero.init_inference to generate",
    "replace_transformer_layer": INJECTION_INSTEAD,
    "revert_transformer_layer": INJECTION_INSTEAD,
    "set_autotp_mode": TENSOR_PARALLEL_INSTEAD,
    "tp_model_init": TENSOR_PARALLEL_INSTEAD,
}
"""DeepSpeed's top-level names (`deepspeed.X`) for features zero-tiering lacks, for `zero`'s module
`__getattr__`: `stand_ins_getattr("zero", "deepspeed", TOP_LEVEL_INSTEAD)`."""
