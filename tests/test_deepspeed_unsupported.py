"""What a DeepSpeed script imports beyond `initialize`: `zero.ops.adam.DeepSpeedCPUAdam` steps bit for bit as
CPUAdam and torch's fused Adam(W) under DeepSpeed's signature and defaults; DeepSpeed's other optimizers,
`zero.pipe`, `zero.moe` and the top-level names zero-tiering lacks raise UnsupportedFeatureError naming
DeepSpeed's feature and saying what to use instead."""
from __future__ import annotations

import importlib
import sys

import pytest
import torch
from models import make_config

import zero
from zero.ops.adam import DeepSpeedCPUAdam
from zero.optim.adam_math import AdamInputError
from zero.optim.cpu_adam import CPUAdam, UnsupportedOptionError
from zero.unsupported import TOP_LEVEL_INSTEAD, UnsupportedFeatureError, raising_getattr

OPTIMIZERS = [
    ("zero.ops.adam", "FusedAdam"),
    ("zero.ops.adam", "ZenFlowCPUAdam"),
    ("zero.ops.lamb", "FusedLamb"),
    ("zero.ops.adagrad", "DeepSpeedCPUAdagrad"),
    ("zero.ops.lion", "DeepSpeedCPULion"),
    ("zero.ops.lion", "FusedLion"),
]


def deepspeed_name(module: str) -> str:
    return "deepspeed" + module.removeprefix("zero")


@pytest.mark.parametrize("module, name", OPTIMIZERS)
def test_other_optimizers_raise_on_import_naming_them(module, name):
    with pytest.raises(UnsupportedFeatureError) as error:
        exec(f"from {module} import {name}", {})
    assert error.value.feature == f"{deepspeed_name(module)}.{name}"
    assert str(error.value).startswith(f"{deepspeed_name(module)}.{name} is not implemented in zero-tiering; "
                                       "instead: pass torch.optim.AdamW")
    assert '"optimizer": {"type": "AdamW"' in str(error.value)
    with pytest.raises(UnsupportedFeatureError):  # and as an attribute, as deepspeed.ops.adam.FusedAdam(...)
        getattr(importlib.import_module(module), name)


def test_unknown_names_stay_import_errors():
    """Only DeepSpeed's names raise the feature error: a typo is still Python's own error."""
    with pytest.raises(ImportError, match="FusedAdamm"):
        exec("from zero.ops.adam import FusedAdamm", {})
    with pytest.raises(AttributeError, match="'zero.ops' has no attribute 'nothing'"):
        zero.ops.nothing  # noqa: B018


def test_fused_transformer_layer_raises():
    with pytest.raises(UnsupportedFeatureError, match="^deepspeed.ops.DeepSpeedTransformerLayer is not implemented"):
        exec("from zero.ops import DeepSpeedTransformerLayer", {})


@pytest.mark.parametrize("statement, feature, instead", [
    ("from zero.pipe import PipelineModule", "deepspeed.pipe (PipelineModule, LayerSpec, TiedLayerSpec: pipeline "
     "parallelism)", "ZeRO-3 data parallelism with offload, which fits a model that pipeline parallelism would "
     "split"),
    ("import zero.pipe", "deepspeed.pipe (", "torch.nn.Sequential"),
    ("from zero.moe.layer import MoE", "deepspeed.moe (MoE layers with expert parallelism)",
     "the experts as ordinary modules"),
])
def test_pipeline_and_moe_raise_on_import(statement, feature, instead):
    for _ in range(2):  # a failed import leaves nothing behind: the next one raises again
        with pytest.raises(UnsupportedFeatureError) as error:
            exec(statement, {})
        assert error.value.feature.startswith(feature)
        assert instead in error.value.instead
        assert "zero.pipe" not in sys.modules and "zero.moe" not in sys.modules


@pytest.mark.parametrize("name", sorted(TOP_LEVEL_INSTEAD))
def test_top_level_names_raise_through_a_module_getattr(name):
    getattr_ = raising_getattr("zero", "deepspeed", TOP_LEVEL_INSTEAD)
    with pytest.raises(UnsupportedFeatureError, match=rf"^deepspeed\.{name} is not implemented in zero-tiering; "
                                                       "instead: "):
        getattr_(name)
    with pytest.raises(AttributeError, match="module 'zero' has no attribute 'initialise'"):
        getattr_("initialise")


def test_the_error_is_a_not_implemented_error():
    assert issubclass(UnsupportedFeatureError, NotImplementedError)


# -- DeepSpeedCPUAdam --------------------------------------------------------------------------------------------

def small_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 8) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_deepspeed_cpu_adam_steps_bitwise_as_cpu_adam_and_torch_fused(adamw_mode):
    """DeepSpeed's positional order (lr, bias_correction, betas, eps, weight_decay); the same hyperparameters
    to CPUAdam and to torch.optim.AdamW / Adam (fused, which CPUAdam equals bit for bit) give the same bits."""
    hyper = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1)
    ours, cpu_adam, reference = small_model(), small_model(), small_model()
    train(ours, DeepSpeedCPUAdam(ours.parameters(), hyper["lr"], True, hyper["betas"], hyper["eps"],
                                 hyper["weight_decay"], adamw_mode=adamw_mode))
    train(cpu_adam, CPUAdam(cpu_adam.parameters(), **hyper, adamw_mode=adamw_mode))
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    train(reference, torch_cls(reference.parameters(), **hyper, fused=True))
    for ours_p, cpu_adam_p, reference_p in zip(ours.parameters(), cpu_adam.parameters(), reference.parameters()):
        assert torch.equal(ours_p, cpu_adam_p)
        assert torch.equal(ours_p, reference_p)


def test_deepspeed_defaults():
    """DeepSpeed's DeepSpeedCPUAdam defaults: no weight decay (CPUAdam's is 0.01, torch's AdamW's), AdamW."""
    optimizer = DeepSpeedCPUAdam(small_model().parameters())
    assert optimizer.defaults["weight_decay"] == 0
    assert optimizer.defaults["decoupled_weight_decay"] is True
    assert (optimizer.defaults["lr"], optimizer.defaults["betas"], optimizer.defaults["eps"]) == (1e-3, (0.9, 0.999),
                                                                                                1e-8)


@pytest.mark.parametrize("argument, value, instead", [
    ("amsgrad", True, "drop amsgrad"),
    ("bias_correction", False, "drop bias_correction"),
    ("fp32_optimizer_states", False, "drop fp32_optimizer_states"),
])
def test_arguments_cpu_adam_cannot_honour_raise_naming_them(argument, value, instead):
    with pytest.raises(UnsupportedFeatureError) as error:
        DeepSpeedCPUAdam(small_model().parameters(), **{argument: value})
    assert error.value.feature == f"DeepSpeedCPUAdam({argument}={value!r})"
    assert instead in error.value.instead


def test_a_param_group_asking_for_amsgrad_raises():
    with pytest.raises(UnsupportedOptionError, match="amsgrad=True"):
        DeepSpeedCPUAdam([{"params": small_model().parameters(), "amsgrad": True}])


def test_any_params_at_construction_cpu_fp32_at_a_step():
    """As DeepSpeed's: built over a bf16 (or meta) model it is a carrier of groups for initialize; a step of its
    own needs CPU fp32 params."""
    model = small_model().to(torch.bfloat16)
    DeepSpeedCPUAdam(torch.nn.Linear(2, 2, device="meta").parameters())
    optimizer = DeepSpeedCPUAdam(model.parameters())
    model(torch.randn(2, 16, dtype=torch.bfloat16)).sum().backward()
    with pytest.raises(AdamInputError, match="param is torch.bfloat16: CPU-Adam steps fp32 tensors"):
        optimizer.step()


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_initialize_takes_its_groups_and_hyperparameters(adamw_mode):
    model = small_model()
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=2e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05,
                                 adamw_mode=adamw_mode)
    engine, engine_optimizer, _, _ = zero.initialize(model=model, optimizer=optimizer,
                                                      config=make_config(1, "cpu", optimizer=None))
    try:
        group = engine_optimizer.param_groups[0]
        assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (2e-3, (0.8, 0.99), 1e-7, 0.05)
        assert group["decoupled"] is adamw_mode
    finally:
        engine.close()
