"""DeepSpeed-format configs, typed and validated: `load_config("ds_config.json")` returns a `Config`.

A user's ds_config.json loads unchanged where zero-tiering supports what it asks for; an unknown key, a
DeepSpeed feature we do not implement, a bad value or an "auto" we cannot fill is a ConfigError naming the
key path. Our own settings live in the `zero_tiering` section.
"""
from .aio import AioSection
from .auto import TrainingArgs
from .checkpoint import CheckpointConfig
from .errors import ConfigError, UnknownKeyError, UnresolvedAutoError, UnsupportedKeyError
from .loader import load_config, read_json
from .optimizer import AdamParams, OptimizerConfig
from .precision import BF16Config, FP16Config
from .scheduler import SchedulerConfig, WarmupCosineLRParams, WarmupDecayLRParams, WarmupLRParams
from .sizes import format_size, parse_size
from .tiering_section import ZeroTieringSection
from .toplevel import Config
from .zero_optimization import OffloadOptimizerConfig, OffloadParamConfig, ZeroOptimizationConfig

__all__ = [
    "AdamParams", "AioSection", "BF16Config", "CheckpointConfig", "Config", "ConfigError", "FP16Config",
    "OffloadOptimizerConfig", "OffloadParamConfig", "OptimizerConfig", "SchedulerConfig", "TrainingArgs",
    "UnknownKeyError", "UnresolvedAutoError", "UnsupportedKeyError", "WarmupCosineLRParams",
    "WarmupDecayLRParams", "WarmupLRParams", "ZeroOptimizationConfig", "ZeroTieringSection", "format_size",
    "load_config", "parse_size", "read_json",
]
