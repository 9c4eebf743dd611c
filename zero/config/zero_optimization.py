"""The `zero_optimization` section: the ZeRO stage, where parameters and optimizer state live (the tiers), and
the stage-3 prefetch and persistence knobs. Names, aliases and defaults are DeepSpeed's."""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Literal

from .errors import ConfigError
from .schema import Section, Unsupported, setting

Device = Literal["none", "cpu", "nvme"]


def _check_nvme_path(device: str, nvme_path: str | tuple[str, ...] | None) -> None:
    if device == "nvme" and not nvme_path:
        raise ConfigError("nvme_path", 'required when device is "nvme": a directory on a local SSD')


def _nvme_directories(value: object) -> object:
    """A list of directories (our extension: DeepSpeed takes one string) as a tuple, checked: not empty, each
    a non-empty string, no directory twice. Anything else is left to the type check."""
    if not isinstance(value, (list, tuple)):
        return value
    if not value:
        raise ValueError("an empty list names no directory: give one directory, or several (one per SSD)")
    if not all(isinstance(path, str) and path for path in value):
        raise ValueError("expected a directory path (a string) or a list of them")
    directories = [os.path.abspath(path) for path in value]
    for i, directory in enumerate(directories):
        if directory in directories[:i]:
            raise ValueError(f"names the directory {directory!r} twice: each holds one file of the store")
    return tuple(value)


@dataclass(frozen=True, kw_only=True)
class OffloadParamConfig(Section):
    """`zero_optimization.offload_param`: where stage 3 keeps this rank's low-precision parameter shards
    between uses."""

    device: Device = "none"
    """Tier: "none" (device memory), "cpu" (host memory) or "nvme" (files under nvme_path)."""

    nvme_path: str | tuple[str, ...] | None = setting(None, convert=_nvme_directories)
    """Directory on a local SSD for the nvme tier; required with device "nvme". A list of directories (one
    per SSD; our extension) spreads the segments over them: a file and an I/O queue in each."""

    buffer_count: int = setting(5, ge=0)
    """Host buffers staging parameter reads from nvme."""

    buffer_size: int = setting(100_000_000, ge=0)
    """Elements per staging buffer."""

    max_in_cpu: int = setting(1_000_000_000, ge=0)
    """With device "nvme": parameter elements that may stay resident in host memory in front of nvme."""

    pin_memory: bool | None = None
    """Page-lock the host buffers (faster, asynchronous host<->device copies). Unset: pinned where CUDA is
    present (DeepSpeed's default is false; ours pins exactly the host budget, so pinning costs nothing more)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_nvme_path(self.device, self.nvme_path)


@dataclass(frozen=True, kw_only=True)
class OffloadOptimizerConfig(Section):
    """`zero_optimization.offload_optimizer`: where the fp32 master weights and Adam moments live; with any
    device but "none" the optimizer step runs on the CPU (CPU-Adam)."""

    device: Device = "none"
    """Tier: "none" (device memory), "cpu" (host memory) or "nvme" (files under nvme_path)."""

    nvme_path: str | tuple[str, ...] | None = setting(None, convert=_nvme_directories)
    """Directory on a local SSD for the nvme tier; required with device "nvme". A list of directories (one
    per SSD; our extension) spreads the segments over them: a file and an I/O queue in each."""

    buffer_count: int = setting(4, ge=0)
    """Host buffers staging optimizer state to and from nvme (DeepSpeed advises >= 4 for Adam)."""

    pin_memory: bool | None = None
    """Page-lock the host buffers; unset: pinned where CUDA is present (see offload_param.pin_memory)."""

    pipeline_read: bool = False
    """Read the next sub-group's state from nvme while the current one is stepped."""

    pipeline_write: bool = False
    """Write the previous sub-group's state to nvme while the current one is stepped."""

    fast_init: bool = False
    """With device "nvme": initialize optimizer state without a read-back from nvme."""

    UNSUPPORTED = {
        "ratio": Unsupported("partial optimizer offload: all of the optimizer state is offloaded", off=1.0),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_nvme_path(self.device, self.nvme_path)


@dataclass(frozen=True, kw_only=True)
class ZeroOptimizationConfig(Section):
    """DeepSpeed's `zero_optimization`. Stage 0: plain data parallel; 1: optimizer state sharded over ranks;
    2: gradients too; 3: parameters too. Sizes counted in elements are elements, as in DeepSpeed."""

    stage: Literal[0, 1, 2, 3] = 0
    """The ZeRO stage."""

    offload_param: OffloadParamConfig = setting(factory=OffloadParamConfig)
    """Parameter tier (stage 3 only)."""

    offload_optimizer: OffloadOptimizerConfig = setting(factory=OffloadOptimizerConfig)
    """Optimizer-state tier."""

    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation)."""

    overlap_comm: bool | None = None
    """Overlap gradient reduction with the backward; null: DeepSpeed's default, true for stage 3 only."""

    reduce_scatter: bool = True
    """Reduce gradients with reduce-scatter (each rank gets its shard) rather than all-reduce."""

    reduce_bucket_size: int = setting(500_000_000, ge=0)
    """Gradient elements reduced at once."""

    allgather_partitions: bool = True
    """After the step, gather updated shards with all-gather rather than a series of broadcasts."""

    allgather_bucket_size: int = setting(500_000_000, ge=0)
    """Parameter elements all-gathered at once (stages 1-2)."""

    elastic_checkpoint: bool = False
    """Allow loading a checkpoint saved with a different number of ranks: ours always reshard on load, so
    either value gets that."""

    ignore_unused_parameters: bool = True
    """Stage 1-2: parameters that get no gradient are fine; false makes them an error."""

    sub_group_size: int = setting(1_000_000_000, ge=0)
    """Parameter elements per optimizer sub-group (the unit CPU-Adam streams through host buffers)."""

    prefetch_bucket_size: int = setting(50_000_000, ge=0, aliases=("stage3_prefetch_bucket_size",))
    """Stage 3: parameter elements fetched ahead of their use along the trace."""

    param_persistence_threshold: int = setting(100_000, ge=0, aliases=("stage3_param_persistence_threshold",))
    """Stage 3: parameters with fewer elements stay resident (not partitioned)."""

    model_persistence_threshold: int = setting(sys.maxsize, ge=0, aliases=("stage3_model_persistence_threshold",))
    """Stage 3: cap on the total elements kept resident by param_persistence_threshold, units taken in plan order
    (params/persistence.py)."""

    max_live_parameters: int = setting(1_000_000_000, ge=0, aliases=("stage3_max_live_parameters",))
    """Stage 3: cap on gathered parameter elements resident at once."""

    max_reuse_distance: int = setting(1_000_000_000, ge=0, aliases=("stage3_max_reuse_distance",))
    """Stage 3: a parameter reused within this many elements of fetches is kept rather than released."""

    gather_16bit_weights_on_model_save: bool = setting(
        False, aliases=("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"))
    """Stage 3: gather the full low-precision weights when the model is saved."""

    zero_quantized_nontrainable_weights: bool = False
    """Stage 3: frozen parameters (an adapter's base) rest in their tier as block-wise int8, decoded into the
    compute dtype where they are gathered: half of bf16's bytes read (params/int8_weights.py)."""

    UNSUPPORTED = {
        "zero_hpz_partition_size": Unsupported("ZeRO++ hierarchical partitioning", off=1),
        "zero_quantized_weights": Unsupported("ZeRO++ quantized weights", off=False),
        "zero_quantized_gradients": Unsupported("ZeRO++ quantized gradients", off=False),
        "zeropp_loco_param": Unsupported("LoCo-ZeRO++", off=None),
        "mics_shard_size": Unsupported("MiCS sharding", off=-1),
        "mics_hierarchical_params_gather": Unsupported("MiCS hierarchical gather", off=False),
        "legacy_stage1": Unsupported("the legacy stage 1 implementation", off=False),
        "load_from_fp32_weights": Unsupported("fp32 master weights rebuilt from the low-precision model weights",
                                              off=True, fix="leave it true: masters load exactly from the checkpoint"),
        "pipeline_loading_checkpoint": Unsupported("pipeline-mode checkpoint loading", off=False),
        "cpu_offload_param": Unsupported("a deprecated offload switch", off=False,
                                         fix='use "offload_param": {"device": "cpu"}'),
        "cpu_offload_use_pin_memory": Unsupported("a deprecated offload switch", off=False,
                                                  fix="use pin_memory in offload_param / offload_optimizer"),
        "zenflow": Unsupported("DeepSpeed ZenFlow (the top-k gradient columns stepped at once on the GPU, the rest "
                               "accumulated and stepped later on the CPU: not AdamW's step)", off=None),
        "save_muon_momentum_buffer_in_memory": Unsupported("the Muon optimizer's buffers (the engine steps Adam and "
                                                           "AdamW)", off=False),
    }
    IGNORED = {
        "round_robin_gradients": "orders DeepSpeed's stage 1-2 gradient copies to host; same values",
        "use_multi_rank_bucket_allreduce": "DeepSpeed's choice of collective for small buckets; same sums",
        "stage3_module_granularity_threshold": "groups small modules into one fetch; same parameters",
        "module_granularity_threshold": "groups small modules into one fetch; same parameters",
        "stage3_use_all_reduce_for_fetch_params": "DeepSpeed's collective for gathering; same parameters",
        "use_all_reduce_for_fetch_params": "DeepSpeed's collective for gathering; same parameters",
        "memory_efficient_linear": "DeepSpeed's own Linear autograd function for stage 3; same arithmetic",
        "override_module_apply": "DeepSpeed's patch of nn.Module.apply for stage 3; ours patches nothing",
        "log_trace_cache_warnings": "logging only",
        "stage3_allgather_sequential": "DeepSpeed's per-parameter gathers instead of bucketed ones; a unit's flat "
                                       "shard is gathered in one here; same parameters",
        "allgather_sequential": "DeepSpeed's per-parameter gathers instead of bucketed ones; a unit's flat shard is "
                                "gathered in one here; same parameters",
        "enable_sanity_checks": "DeepSpeed's internal debugging checks",
        "leaf_module": "DeepSpeed's ZeRO-3 leaf modules by config; a block (the wrap policy's unit) is gathered whole "
                       "here already, as set_z3_leaf_modules is accepted",
    }

    @classmethod
    def from_json(cls, data: object, path: str, ignored: list[str]) -> Any:
        """DeepSpeed's deprecated `cpu_offload` (still read by DeepSpeed 0.19) is `offload_optimizer` on cpu:
        true becomes that section where the config has none; false changes nothing. `offload_param` below stage 3
        is ignored, with a warning, as DeepSpeed ignores it there (scripts set it whatever their stage)."""
        if isinstance(data, Mapping) and isinstance(data.get("stage", 0), int) and data.get("stage", 0) < 3 \
                and isinstance(data.get("offload_param"), Mapping) \
                and data["offload_param"].get("device", "none") not in ("none", None):
            data = dict(data)
            device = data.pop("offload_param")["device"]
            ignored.append(f"{path}.offload_param")
            warnings.warn(f"{path}.offload_param (device {device!r}) is read at stage 3 only, as DeepSpeed reads it: "
                          f"ignored at stage {data.get('stage', 0)}; parameters stay on the device", stacklevel=2)
        if isinstance(data, Mapping) and "cpu_offload" in data:
            data = dict(data)
            legacy = data.pop("cpu_offload")
            if not isinstance(legacy, bool):
                raise ConfigError(f"{path}.cpu_offload", "true or false", value=legacy)
            if legacy:
                if "offload_optimizer" in data:
                    raise ConfigError(f"{path}.cpu_offload", "names the same setting as offload_optimizer; keep "
                                      "one of the two", value=legacy)
                data["offload_optimizer"] = {"device": "cpu"}
        return super().from_json(data, path, ignored)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        if self.offload_param.device != "none" and self.stage != 3:
            raise ConfigError("offload_param.device",
                              f"parameter offload needs stage 3 (stage is {self.stage})",
                              value=self.offload_param.device)
