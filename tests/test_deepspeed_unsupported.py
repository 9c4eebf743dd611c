"""What a DeepSpeed script imports beyond `initialize`: `zero.ops.adam.DeepSpeedCPUAdam` steps bit for bit as
CPUAdam and torch's fused Adam(W) under DeepSpeed's signature and defaults, and FusedAdam trains through the
engine; DeepSpeed's other optimizers, `zero.pipe`, `zero.moe.layer` and the top-level names zero-tiering lacks
import, and raise UnsupportedFeatureError naming DeepSpeed's feature and saying what to use instead when a script
builds them; `moe.utils`' helpers serve a dense model."""
from __future__ import annotations

import importlib

import pytest
import torch
from models import make_config

import zero
from zero.ops.adam import DeepSpeedCPUAdam
from zero.optim.adam_math import AdamInputError
from zero.optim.cpu_adam import CPUAdam, UnsupportedOptionError
from zero.integrations.unsupported import TOP_LEVEL_INSTEAD, UnsupportedFeatureError

OPTIMIZERS = [
    ("zero.ops.adam", "ZenFlowCPUAdam"),
    ("zero.ops.lamb", "FusedLamb"),
    ("zero.ops.adagrad", "DeepSpeedCPUAdagrad"),
    ("zero.ops.lion", "DeepSpeedCPULion"),
    ("zero.ops.lion", "FusedLion"),
]


def deepspeed_name(module: str) -> str:
    return "deepspeed" + module.removeprefix("zero")


@pytest.mark.parametrize("module, name", OPTIMIZERS)
def test_other_optimizers_import_and_raise_when_built_naming_them(module, name):
    namespace: dict = {}
    exec(f"from {module} import {name}", namespace)  # a script may import it for a branch it never takes
    with pytest.raises(UnsupportedFeatureError) as error:
        namespace[name]([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    assert error.value.feature == f"{deepspeed_name(module)}.{name}"
    assert str(error.value).startswith(f"{deepspeed_name(module)}.{name} is not implemented in zero-tiering; "
                                       "instead: pass torch.optim.AdamW")
    assert '"optimizer": {"type": "AdamW"' in str(error.value)
    assert getattr(importlib.import_module(module), name) is namespace[name]  # as deepspeed.ops.lamb.FusedLamb


def test_unknown_names_stay_import_errors():
    """Only DeepSpeed's names raise the feature error: a typo is still Python's own error."""
    with pytest.raises(ImportError, match="FusedAdamm"):
        exec("from zero.ops.adam import FusedAdamm", {})
    with pytest.raises(AttributeError, match="'zero.ops' has no attribute 'nothing'"):
        zero.ops.nothing  # noqa: B018


def test_fused_transformer_layer_raises_when_built():
    from zero.ops import DeepSpeedTransformerLayer

    with pytest.raises(UnsupportedFeatureError, match="^deepspeed.ops.DeepSpeedTransformerLayer is not implemented"):
        DeepSpeedTransformerLayer(config=None)


@pytest.mark.parametrize("statement, name, feature, instead", [
    ("from zero.pipe import PipelineModule", "PipelineModule", "deepspeed.pipe.PipelineModule",
     "ZeRO-3 data parallelism with offload, which fits a model that pipeline parallelism would split"),
    ("from zero.pipe import LayerSpec", "LayerSpec", "deepspeed.pipe.LayerSpec", "torch.nn.Sequential"),
    ("from zero.moe.layer import MoE", "MoE", "deepspeed.moe.layer.MoE", "the experts as ordinary modules"),
])
def test_pipeline_and_moe_import_and_raise_when_built(statement, name, feature, instead):
    namespace: dict = {}
    exec(statement, namespace)

    class Sub(namespace[name]):  # a script's own subclass is defined; building it raises
        pass

    for cls in (namespace[name], Sub):
        with pytest.raises(UnsupportedFeatureError) as error:
            cls(hidden_size=4)
        assert error.value.feature == feature and instead in error.value.instead


@pytest.mark.parametrize("module, name, instead", [
    ("zero.ops.op_builder", "AsyncIOBuilder", "its NVMe I/O is tiering's"),
    ("zero.ops.sparse_attention", "FixedSparsityConfig", "the model's own dense attention"),
    ("zero.module_inject", "replace_transformer_layer", "there is no kernel injection"),
    ("zero.module_inject", "LinearAllreduce", "there is no tensor, model or sequence parallelism"),
    ("zero.sequence.layer", "DistributedAttention", "there is no sequence (Ulysses) parallelism"),
    ("zero.runtime.data_pipeline.data_routing.helper", "convert_to_random_ltd", "DeepSpeed Data Efficiency"),
    ("zero.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr",
     "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed", "DeepSpeed Data Efficiency"),
    ("zero.runtime.domino.transformer", "DominoTransformer", "there is no tensor, model or sequence parallelism"),
    ("zero.compression.compress", "init_compression", "DeepSpeed Compression is absent"),
    ("zero.comm", "TorchBackend", "DeepSpeed's backend classes are absent"),
    ("zero.inference", "RaggedInferenceEngineConfig", "zero.init_inference(model, dtype=...)"),
])
def test_deepspeed_modules_for_features_not_here_import_and_raise_when_used(module, name, instead):
    """A DeepSpeed module zero-tiering has no feature for still imports, and the name a script takes from it raises
    UnsupportedFeatureError naming it where it is called or built (before: an ImportError, 'unknown location')."""
    namespace: dict = {}
    exec(f"from {module} import {name}", namespace)
    with pytest.raises(UnsupportedFeatureError) as error:
        namespace[name]()
    assert error.value.feature == f"{deepspeed_name(module)}.{name}" and instead in error.value.instead
    with pytest.raises(ImportError):
        exec(f"from {module} import {name}Typo", {})


def test_moe_utils_serve_a_dense_model_and_refuse_expert_parameters():
    from zero.moe.utils import configure_moe_param_groups, is_moe_param, split_params_into_different_moe_groups_for_optimizer

    model = torch.nn.Linear(4, 4)
    group = {"params": list(model.parameters()), "weight_decay": 0.1}
    assert split_params_into_different_moe_groups_for_optimizer(group) == [group]
    assert split_params_into_different_moe_groups_for_optimizer((group,)) == [group]
    params = list(model.parameters())
    assert configure_moe_param_groups(params) == params and not is_moe_param(params[0])
    model.weight.allreduce = False  # DeepSpeed's mark of an expert parameter
    with pytest.raises(UnsupportedFeatureError, match="expert parameters"):
        split_params_into_different_moe_groups_for_optimizer([group])


@pytest.mark.parametrize("name", sorted(TOP_LEVEL_INSTEAD))
def test_top_level_names_import_and_raise_when_built(name):
    stand_in = getattr(zero, name)
    with pytest.raises(UnsupportedFeatureError, match=rf"^deepspeed\.{name} is not implemented in zero-tiering; "
                                                       "instead: "):
        stand_in()
    with pytest.raises(AttributeError, match="module 'zero' has no attribute 'initialise'"):
        zero.initialise  # noqa: B018


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


# -- FusedAdam ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam"])
def test_fused_adam_is_torchs_adam_under_deepspeeds_signature_and_trains_through_the_engine(adam_w_mode):
    from zero.ops.adam import FusedAdam

    hyper = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1)
    ours, reference = small_model(), small_model()
    train(ours, FusedAdam(ours.parameters(), hyper["lr"], True, hyper["betas"], hyper["eps"], adam_w_mode,
                          hyper["weight_decay"]))
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    train(reference, torch_cls(reference.parameters(), **hyper))
    for ours_p, reference_p in zip(ours.parameters(), reference.parameters()):
        assert torch.equal(ours_p, reference_p)

    runs = []
    for make in (lambda ps: FusedAdam(ps, adam_w_mode=adam_w_mode, **hyper), lambda ps: torch_cls(ps, **hyper)):
        model = small_model()
        engine, *_ = zero.initialize(model=model, optimizer=make(model.parameters()),
                                     config=make_config(stage=2, optimizer=None))
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
        runs.append([p.detach().clone() for p in model.parameters()])
        engine.close()
    assert all(torch.equal(a, b) for a, b in zip(*runs))
