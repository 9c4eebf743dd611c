"""DeepSpeed's `init_inference` arguments as a config of ours. A script written for DeepSpeed calls
`init_inference(model, mp_size=1, dtype=torch.half, replace_with_kernel_inject=False)`, or passes those keys as
`config` (a dict or a JSON file: DeepSpeed's inference config, deepspeed/inference/config.py), the two merged as
DeepSpeed merges them (a key in both with two values is an error).

What maps becomes ours: `dtype` the compute dtype (DeepSpeed's default, torch.float16, where none is given),
`zero` at stage 3 the zero_optimization section (else the weights wait in host memory, our default), tensor
parallelism of one rank. What asks for a feature zero-tiering lacks (tensor parallelism over several ranks, kernel
injection, DeepSpeed's checkpoint loading, CUDA graphs) raises UnsupportedFeatureError naming the key; what only
DeepSpeed's injected kernels or MoE layers read is accepted and changes nothing here; any other key is a ConfigError.
A config of ours (a training-format one, e.g. with zero_optimization) is passed on as it is.
"""
from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..config import ConfigError, ZeroOptimizationConfig, read_json
from ..integrations.unsupported import INJECTION_INSTEAD, TENSOR_PARALLEL_INSTEAD, UnsupportedFeatureError

Source = str | os.PathLike | Mapping[str, Any]

TRAINING_KEYS = frozenset(("zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu",
                           "gradient_accumulation_steps", "bf16", "bfloat16", "fp16", "zero_tiering", "aio"))
"""Keys that make a config ours (training format); DeepSpeed's inference config has none of them."""

ALIASES = {"kernel_inject": "replace_with_kernel_inject", "tp": "tensor_parallel", "tm": "triangular_masking",
           "injection_dict": "injection_policy", "ckpt_config": "checkpoint_config", "args": "config",
           "max_tokens": "max_out_tokens", "min_tokens": "min_out_tokens", "expert_group": "ep_group",
           "expert_mp_group": "ep_mp_group"}
"""DeepSpeed's other spellings of its inference keys."""

DTYPES = {torch.float16: {"fp16": {"enabled": True}}, torch.bfloat16: {"bf16": {"enabled": True}}, torch.float32: {}}
"""The compute dtypes, as our precision sections."""

DTYPE_NAMES = {**dict.fromkeys(("torch.float16", "fp16", "float16", "half"), torch.float16),
               **dict.fromkeys(("torch.bfloat16", "bf16", "bfloat16", "bfloat"), torch.bfloat16),
               **dict.fromkeys(("torch.float32", "fp32", "float32", "float"), torch.float32),
               **dict.fromkeys(("torch.int8", "int8"), torch.int8)}
"""DeepSpeed's spellings of a dtype in a JSON config."""

CHECKPOINT_INSTEAD = ("init_inference(model, weights=DIR): DIR a save_pretrained directory of safetensors (sharded or "
                      "not) or zero-tiering's export, read unit by unit into the tiers; DeepSpeed's checkpoint loading "
                      "(its JSON list of checkpoint files, tensor-parallel shards) is absent")


def _falsy(value: object) -> bool:
    return not value


def _one(value: object) -> bool:
    return value in (None, 1)


def _empty(value: object) -> bool:
    return not value or (isinstance(value, Mapping) and not any(value.values()))


REFUSED: dict[str, tuple[Callable[[object], bool], str]] = {
    **dict.fromkeys(("replace_with_kernel_inject", "injection_policy", "injection_policy_tuple", "use_triton",
                     "triton_autotune"), (_falsy, INJECTION_INSTEAD)),
    "enable_cuda_graph": (_falsy, "the model's forward run eagerly; DeepSpeed's CUDA graph capture is absent"),
    "mp_size": (_one, TENSOR_PARALLEL_INSTEAD),
    "mpu": (_falsy, TENSOR_PARALLEL_INSTEAD),
    "training_mp_size": (_one, CHECKPOINT_INSTEAD),
    **dict.fromkeys(("checkpoint", "base_dir", "save_mp_checkpoint_path", "set_empty_params"),
                    (_falsy, CHECKPOINT_INSTEAD)),
    "checkpoint_config": (_empty, CHECKPOINT_INSTEAD),
}
"""Keys for features zero-tiering lacks: what says the feature is off, and what to use instead."""

KERNELS_ONLY = "read only by DeepSpeed's injected kernels, which are not here"
MOE_ONLY = "read only by DeepSpeed's MoE layers, which are not here (deepspeed.moe.layer.MoE raises)"
IGNORED = {
    **dict.fromkeys(("triangular_masking", "return_tuple", "max_out_tokens", "min_out_tokens", "transposed_mode",
                     "config"), KERNELS_ONLY),
    **dict.fromkeys(("moe", "ep_size", "ep_group", "ep_mp_group", "moe_experts", "moe_type"), MOE_ONLY),
    "quant": "read only with dtype torch.int8, which is refused",
    "keep_module_on_host": "the weights stay in host memory or on nvme either way",
    "replace_method": "deprecated; DeepSpeed ignores it too",
}
"""Keys accepted whatever their value, each with why it cannot change what runs here."""

TP_KEYS = frozenset(("enabled", "tp_size", "tp_grain_size", "mpu", "tp_group"))
"""DeepSpeed's tensor_parallel section."""


def ours(config: Source | None, kwargs: Mapping[str, Any], default: Mapping[str, Any]) -> Source:
    """What init_inference loads: `default` for no config and no arguments, a config of ours as given, else
    DeepSpeed's inference config (`config` merged with `kwargs`) translated onto `default`."""
    if config is None and not kwargs:
        return default
    raw = read_json(config) if isinstance(config, (str, os.PathLike)) else dict(config or {})
    if TRAINING_KEYS & raw.keys():
        if kwargs:
            raise ConfigError(next(iter(kwargs)), "DeepSpeed's init_inference arguments go with its inference config, "
                                                  "not with a training-format config (zero_optimization, bf16, ...): "
                                                  "set that config's keys instead")
        return config
    for key in raw.keys() & kwargs.keys():
        if raw[key] != kwargs[key]:
            raise ConfigError(key, f"given in config as {raw[key]!r} and as an argument as {kwargs[key]!r}")
    return _translate({**raw, **kwargs}, default)


def _translate(settings: Mapping[str, Any], default: Mapping[str, Any]) -> dict[str, Any]:
    spelled: dict[str, str] = {}
    for key in settings:
        name = ALIASES.get(key, key)
        if name in spelled:
            raise ConfigError(key, f"names the same setting as {spelled[name]}; keep one of the two")
        spelled[name] = key
    config = copy.deepcopy(dict(default))
    for name, key in spelled.items():
        value = settings[key]
        if name in REFUSED:
            is_off, instead = REFUSED[name]
            if not is_off(value):
                raise UnsupportedFeatureError(f"init_inference({key}={value!r})", instead)
        elif name == "tensor_parallel":
            _check_tensor_parallel(key, value)
        elif name == "zero":
            config["zero_optimization"] = _zero(key, value, default["zero_optimization"])
        elif name not in IGNORED and name != "dtype":
            raise ConfigError(key, "neither a key of DeepSpeed's inference config (deepspeed/inference/config.py) "
                                   "nor of a training-format config (with zero_optimization)")
    dtype = spelled.get("dtype")
    return config | (_precision(dtype, settings[dtype]) if dtype else copy.deepcopy(DTYPES[torch.float16]))


def _precision(key: str, value: object) -> dict[str, Any]:
    dtype = DTYPE_NAMES.get(value) if isinstance(value, str) else value
    if dtype == torch.int8:
        raise UnsupportedFeatureError(f"init_inference({key}={value!r})", "dtype torch.bfloat16 or torch.float16 (the "
                                      "weights in 16 bits); DeepSpeed's int8 inference kernels are absent")
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPES:
        raise ConfigError(key, "DeepSpeed's inference dtypes are torch.float16, torch.bfloat16, torch.float32 (and "
                               "torch.int8)", value=value)
    return copy.deepcopy(DTYPES[dtype])


def _check_tensor_parallel(key: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"expected DeepSpeed's tensor_parallel section, a dict of {sorted(TP_KEYS)}",
                          value=value)
    unknown = sorted(value.keys() - TP_KEYS)
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}",
                          f"not a key of DeepSpeed's tensor_parallel section ({sorted(TP_KEYS)})")
    if not _one(value.get("tp_size")) or any(value.get(sub) is not None for sub in ("mpu", "tp_group")):
        raise UnsupportedFeatureError(f"init_inference({key}={dict(value)!r})", TENSOR_PARALLEL_INSTEAD)


def _zero(key: str, value: object, default: Mapping[str, Any]) -> Mapping[str, Any]:
    """DeepSpeed's `zero` section at stage 3 as our zero_optimization (checked here, so that errors name `zero.*`);
    below stage 3 DeepSpeed keeps the weights whole on the device, and ours wait in the tier `default` names."""
    if not (isinstance(value, Mapping) and value.get("stage") == 3):
        return default
    ZeroOptimizationConfig.from_json(value, key, [])
    return dict(value)
