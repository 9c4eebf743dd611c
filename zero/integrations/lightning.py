"""Lightning's Trainer and Fabric on our engine: the strategy Lightning's own DeepSpeedStrategy is, for zero-tiering.

    Trainer(strategy="zero3_offload")           # ZeRO-3, parameters and optimizer state in host memory
    Trainer(strategy="zero3_offload_nvme")      # ... on nvme, under $ZERO_TIERING_NVME_PATH (default: the temp dir)
    Trainer(strategy=ZeroStrategy(config="ds_config.json"))   # a DeepSpeed-format config, as it is
    Fabric(strategy="zero3_offload")            # the same for Fabric (ZeroFabricStrategy)

Importing this module registers the names (Lightning is an optional dependency: `pip install lightning`). What the
strategy does, as DeepSpeedStrategy does with DeepSpeed's engine: the engine is built in `setup` from the module and
the one optimizer `configure_optimizers` gives (its hyperparameters taken over; Lightning steps its scheduler); the
engine owns backward and step through the precision plugin (`ZeroPrecision`, whatever precision plugin Lightning
made: Lightning hands a registered strategy a plugin of its own choosing); `Trainer(accumulate_grad_batches=N,
gradient_clip_val=c, precision=...)` become the config's gradient_accumulation_steps, gradient_clipping and bf16 /
fp16 sections (a config that says otherwise is an error naming both); a model built in `configure_model` is built
under `zero.Init` (never whole in host memory); a checkpoint is the engine's (a directory: every rank writes its part,
Lightning's own state as its client state), and `fit(ckpt_path=...)` loads it once the engine exists. Lightning
special-cases DeepSpeedStrategy by type in places; here: the model summary callbacks count partitioned parameters
by their `ds_numel` (PartitionedSummary); what cannot be served (several optimizers, manual optimization,
clipping by value, a precision the engine does not compute in, a compiled module, an accumulation scheduler) is an
error at `fit`. Several ranks come through Lightning's own launcher (gloo on CPU, NCCL on GPUs).
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Generator, Mapping
from typing import Any

import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.callbacks.gradient_accumulation_scheduler import GradientAccumulationScheduler
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_summary.model_summary import ModelSummary as Summary
from torch import nn
from torch.utils._pytree import tree_map

from ..config import Config, ConfigError, read_json
from ..config.schema import spelling
from ..engine import ZeroEngine
from ..initialize import initialize
from ..params.init_partition import Init

PRECISIONS = {"32-true": None, "32": None, "bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16",
              "16-true": "fp16"}
"""Lightning's precision settings the engine computes in, and the config section each turns on."""
COMPUTE_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


def strategy_config(config: str | os.PathLike | Mapping | None, offload: str, nvme_path: str | None) -> dict:
    """The config a strategy starts from: the caller's (a dict or a ds_config.json path), else ZeRO-3 with the
    parameters and optimizer state offloaded to `offload` ("cpu" or "nvme", under `nvme_path`)."""
    if config is not None:
        config = json.loads(json.dumps(config)) if isinstance(config, Mapping) else read_json(config)
        if "train_batch_size" not in config:  # the batch is the loop's: the engine's count is for its reports
            config.setdefault("train_micro_batch_size_per_gpu", 1)
        return config
    section = {"device": offload}
    if offload == "nvme":
        section["nvme_path"] = nvme_path or os.environ.get("ZERO_TIERING_NVME_PATH", tempfile.gettempdir())
    return {"train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "offload_param": dict(section), "offload_optimizer": dict(section)}}


def with_run_settings(config: dict, *, accumulation: int, clip: float | None, clip_algorithm: str | None,
                      precision: str) -> dict:
    """`config` with what the Trainer or Fabric was told: accumulation, clipping (by norm) and precision. A config
    that sets one of them otherwise is a ConfigError naming both. `clip`: the Trainer's gradient_clip_val (0.0:
    none), the clipping of a config that sets none; None (Fabric): the config's own, absent meaning the engine's
    default (1.0, as DeepSpeed's)."""
    config = json.loads(json.dumps(config))
    if config.get("gradient_accumulation_steps", accumulation) != accumulation:
        raise ConfigError("gradient_accumulation_steps", f"the config says {config['gradient_accumulation_steps']}, "
                          f"Lightning's accumulate_grad_batches {accumulation}: set one of them",
                          value=config["gradient_accumulation_steps"])
    config["gradient_accumulation_steps"] = accumulation
    if clip_algorithm == "value" and clip:
        raise MisconfigurationException("the zero-tiering strategy clips gradients by their global norm only "
                                        "(gradient_clip_algorithm='norm')")
    if "gradient_clipping" in config and clip and config["gradient_clipping"] != clip:
        raise ConfigError("gradient_clipping", f"the config says {config['gradient_clipping']}, Lightning's "
                          f"gradient_clip_val {clip}: set one of them", value=config["gradient_clipping"])
    if clip is not None:
        config.setdefault("gradient_clipping", clip)
    if precision not in PRECISIONS:
        raise MisconfigurationException(f"precision {precision!r}: the zero-tiering strategy computes in "
                                        f"{', '.join(PRECISIONS)}")
    wanted = PRECISIONS[precision]
    keys = {section: spelling(config, Config, section) for section in ("bf16", "fp16")}  # bf16 may be `bfloat16`
    for section, key in keys.items():
        enabled = isinstance(config.get(key), Mapping) and bool(config[key].get("enabled", False))
        if enabled and section != wanted:
            raise ConfigError(f"{key}.enabled", f"the config computes in {section}, Lightning's precision is "
                              f"{precision!r}: set one of them", value=True)
    if wanted is not None:
        config[keys[wanted]] = {**(config.get(keys[wanted]) or {}), "enabled": True}
    return config


# -- the Trainer ------------------------------------------------------------------------------------------------


class ZeroPrecision(Precision):
    """The engine's backward and step, whatever precision Lightning was asked for (the engine computes in it)."""

    def __init__(self, precision: str = "32-true"):
        self.precision = precision

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        # Lightning divides each micro-batch's loss by accumulate_grad_batches; the engine's backward does too.
        strategy = model.trainer.strategy
        strategy.engine.backward(tensor * strategy.engine.gradient_accumulation_steps())

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        result = closure()
        self._after_closure(model, optimizer)
        if result is None:
            raise MisconfigurationException("training_step returned None: the zero-tiering strategy cannot skip a "
                                            "step's backward (the engine counts micro-batches)")
        model.trainer.strategy.engine.step()  # applies the optimizer at the accumulation boundary only
        return result

    def clip_gradients(self, *args: Any, **kwargs: Any) -> None:
        """The engine clips (the config's gradient_clipping, from gradient_clip_val) at its step."""

    def convert_input(self, data: Any) -> Any:
        """A batch's floating tensors in the dtype the engine computes in (as DeepSpeed's precision plugin does:
        the engine's parameters are in it, with no autocast around them)."""
        dtype = COMPUTE_DTYPES[PRECISIONS.get(self.precision)]
        if dtype is None:
            return data
        return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, data)


class ZeroStrategy(DDPStrategy):
    """ZeRO-3 with offload, by zero-tiering, for Lightning's Trainer. `config`: a DeepSpeed-format config (a dict or a
    ds_config.json path); without one, ZeRO-3 with parameters and optimizer state offloaded to `offload` ("cpu" or
    "nvme", under `nvme_path`). The rest are DDPStrategy's (`start_method="spawn"` runs the ranks in this process's
    children, as DDP's spawn strategy)."""

    strategy_name = "zero3_offload"

    def __init__(self, config: str | os.PathLike | Mapping | None = None, *, offload: str = "cpu",
                 nvme_path: str | None = None, **ddp_kwargs: Any):
        # No plugin of our own here: given one, Lightning would ignore the Trainer's `precision=`; it makes one from
        # that flag and hands it to the setter below, which wraps it.
        super().__init__(**ddp_kwargs)
        self.base_config = strategy_config(config, offload, nvme_path)
        self.engine: ZeroEngine | None = None

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else ZeroPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, ZeroPrecision):
            plugin = ZeroPrecision(str(plugin.precision))
        self._precision_plugin = plugin

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine, which loads it, exists only once `setup` ran

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def setup(self, trainer: Any) -> None:
        self.accelerator.setup(trainer)
        module = self.lightning_module
        refuse_unserved(trainer, module)
        config = with_run_settings(self.base_config, accumulation=trainer.accumulate_grad_batches,
                                   clip=trainer.gradient_clip_val or 0.0,
                                   clip_algorithm=trainer.gradient_clip_algorithm,
                                   precision=str(self.precision_plugin.precision))
        if self.engine is not None:  # validate or test after fit: the same engine, the same weights
            self.model = self.engine
            self.barrier()
            return
        self.optimizers, self.lr_scheduler_configs = [], []
        optimizer = None
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
            if len(optimizers) != 1 or len(schedulers) > 1:
                raise MisconfigurationException(f"the zero-tiering strategy trains with one optimizer and at most one "
                                                f"scheduler; configure_optimizers gave {len(optimizers)} and "
                                                f"{len(schedulers)}")
            optimizer, self.lr_scheduler_configs = optimizers[0], schedulers
        self.engine, zero_optimizer, _, _ = initialize(model=module, optimizer=optimizer, config=config)
        self.engine.lr_scheduler = None  # Lightning steps the configured scheduler (it shares the param groups)
        self.model = self.engine
        if optimizer is not None:
            self.optimizers = [zero_optimizer]
        for callback in trainer.callbacks:  # Lightning's summaries count the 0-element placeholders
            if isinstance(callback, ModelSummary):
                callback._summary = lambda trainer, pl_module, depth=callback._max_depth: PartitionedSummary(
                    pl_module, max_depth=depth)
        self.barrier()

    def setup_optimizers(self, trainer: Any) -> None:
        """Nothing: `setup` builds the engine from the module's one optimizer."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        return model  # no DistributedDataParallel: the engine reduces the gradients

    def model_to_device(self) -> None:
        """Nothing: the engine places the parameters."""

    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """configure_model builds the model partitioned as it is built (zero.Init): never whole in host memory."""
        with Init(config_dict_or_path=self.base_config):
            yield

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        yield  # where the model is built zero.Init decides (model_sharded_context)

    # -- checkpoints: the engine's, Lightning's state as its client state ---------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # in the engine's checkpoint (gathering the model here would hold it whole in memory)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        filepath = self.broadcast(str(filepath))
        client = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(filepath, tag="checkpoint", client_state=client)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        _, client = self.engine.load_checkpoint(str(checkpoint_path), tag="checkpoint")
        return client

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: `load_checkpoint` loaded the weights into the engine."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: `load_checkpoint` loaded the optimizer state into the engine."""

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    def teardown(self) -> None:
        """The engine stays (a later validate or test, or the caller's `strategy.engine.close()`; an engine never
        closed removes its files when the process ends)."""
        super().teardown()


def refuse_unserved(trainer: Any, module: Any) -> None:
    """What the strategy cannot serve, named at `fit` rather than trained around."""
    if not module.automatic_optimization:
        raise MisconfigurationException("the zero-tiering strategy owns backward and step: manual optimization "
                                        "(automatic_optimization = False) is not supported")
    if getattr(module, "_compiler_ctx", None) is not None:
        raise MisconfigurationException("the zero-tiering strategy partitions the module's parameters, which a "
                                        "compiled module would not see: pass the module uncompiled")
    if any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
        raise MisconfigurationException("the engine's gradient accumulation is fixed for a run: use "
                                        "Trainer(accumulate_grad_batches=N), not a GradientAccumulationScheduler")


def _numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


class PartitionedSummary(Summary):
    """Lightning's model summary (the table ModelSummary and RichModelSummary print), counting a partitioned
    parameter by its `ds_numel` (DeepSpeed's attribute, which the engine sets), not its 0-element placeholder."""

    @property
    def param_nums(self) -> list[int]:
        return [sum(_numel(p) for p in layer._module.parameters()) for layer in self._layer_summary.values()]

    @property
    def total_parameters(self) -> int:
        return sum(_numel(p) for p in self._model.parameters())

    @property
    def trainable_parameters(self) -> int:
        return sum(_numel(p) for p in self._model.parameters() if p.requires_grad)


# -- Fabric -----------------------------------------------------------------------------------------------------


class ZeroFabricPrecision(FabricPrecision):
    """Fabric's precision plugin, whatever Fabric chose: the engine computes in the precision it was asked for."""

    def __init__(self, precision: str = "32-true"):
        self.precision = precision


class ZeroFabricStrategy(FabricDDPStrategy):
    """ZeRO-3 with offload, by zero-tiering, for Lightning Fabric: `fabric.setup(model, optimizer)` builds the
    engine (a model built inside `fabric.init_module()` is partitioned as it is built), `fabric.backward(loss)` and
    `optimizer.step()` are the engine's, `fabric.save` / `fabric.load` its checkpoint with the rest of the state as
    its client state. Accumulation and clipping are the config's (gradient_accumulation_steps, gradient_clipping;
    absent, 1.0 as DeepSpeed's): step the optimizer after every backward; the engine applies it at the accumulation boundary."""

    def __init__(self, config: str | os.PathLike | Mapping | None = None, *, offload: str = "cpu",
                 nvme_path: str | None = None, **ddp_kwargs: Any):
        super().__init__(**ddp_kwargs)  # (no plugin of our own: see ZeroStrategy)
        self.base_config = strategy_config(config, offload, nvme_path)
        self.engine: ZeroEngine | None = None
        self._backward_sync_control = None

    @property
    def precision(self) -> FabricPrecision:
        return self._precision if self._precision is not None else ZeroFabricPrecision()

    @precision.setter
    def precision(self, plugin: FabricPrecision | None) -> None:
        if plugin is not None and not isinstance(plugin, ZeroFabricPrecision):
            plugin = ZeroFabricPrecision(str(plugin.precision))
        self._precision = plugin

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list, scheduler: Any = None):
        if len(optimizers) != 1:
            raise ValueError(f"the zero-tiering strategy trains with one optimizer; fabric.setup got {len(optimizers)}")
        config = self.base_config
        accumulation = config.get("gradient_accumulation_steps", 1)
        config = with_run_settings(config, accumulation=accumulation, clip=None, clip_algorithm="norm",
                                   precision=str(self.precision.precision))
        self.engine, zero_optimizer, _, _ = initialize(model=module, optimizer=optimizers[0], config=config)
        self.engine.lr_scheduler = None  # the caller steps its scheduler (it shares the param groups)
        return self.engine, [zero_optimizer], scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        raise NotImplementedError("the zero-tiering strategy builds its engine from the module and its optimizer "
                                  "together: call fabric.setup(model, optimizer)")

    def setup_optimizer(self, optimizer: Any) -> Any:
        raise NotImplementedError("the zero-tiering strategy builds its engine from the module and its optimizer "
                                  "together: call fabric.setup(model, optimizer)")

    def module_to_device(self, module: nn.Module) -> None:
        """Nothing: the engine places the parameters."""

    @contextlib.contextmanager
    def module_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        with Init(config_dict_or_path=self.base_config):
            yield

    def backward(self, tensor: torch.Tensor, module: Any = None, *args: Any, **kwargs: Any) -> None:
        self.engine.backward(tensor)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self.engine.step()  # applies the optimizer at the accumulation boundary only

    def clip_gradients_norm(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("the engine clips by the config's gradient_clipping at its step")

    def clip_gradients_value(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("the engine clips by the global norm only (the config's gradient_clipping)")

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None,
                        filter: Any = None) -> None:
        path = self.broadcast(str(path))
        client = {k: v for k, v in self._convert_stateful_objects_in_state(
            {k: v for k, v in state.items() if not _is_ours(v, self.engine)}, filter=filter or {}).items()}
        self.engine.save_checkpoint(path, tag="checkpoint", client_state=client)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        _, client = self.engine.load_checkpoint(str(path), tag="checkpoint")
        client = dict(client or {})
        if state is None:
            return client
        for key, target in state.items():
            if _is_ours(target, self.engine) or key not in client:
                continue
            value = client.pop(key)
            if hasattr(target, "load_state_dict"):
                target.load_state_dict(value)
            elif isinstance(target, dict):
                target.update(value)
            else:
                state[key] = value
        return client

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        super().teardown()


def _is_ours(value: Any, engine: ZeroEngine | None) -> bool:
    """The engine, its module or its optimizer: in the engine's checkpoint already."""
    inner = getattr(value, "_forward_module", getattr(value, "_optimizer", value))
    return engine is not None and (inner is engine or inner is engine.module or inner is engine.optimizer
                                   or value is engine.optimizer)


# -- names ------------------------------------------------------------------------------------------------------

NAMES = {"zero3_offload": "cpu", "zero3_offload_nvme": "nvme"}
for _name, _offload in NAMES.items():
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, ZeroStrategy, description=f"zero-tiering ZeRO-3, offload to {_offload}",
                                  offload=_offload)
    if _name not in FABRIC_STRATEGIES:
        FABRIC_STRATEGIES.register(_name, ZeroFabricStrategy, description=f"zero-tiering ZeRO-3, offload to "
                                   f"{_offload}", offload=_offload)
