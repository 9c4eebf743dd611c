"""`zero.init_inference` called as DeepSpeed's is (inference/huggingface/*: `mp_size`, `dtype`,
`replace_with_kernel_inject`, `tensor_parallel`, or those keys as its `config`, a dict or a JSON file): what maps runs
(the dtype, one rank of tensor parallelism, a `zero` section), a feature zero-tiering lacks raises
UnsupportedFeatureError naming the key, and a key DeepSpeed does not have is a ConfigError naming it."""
from __future__ import annotations

import json

import pytest
import torch

import zero
from zero.config import ConfigError
from zero.inference import deepspeed_config
from zero.inference.engine import DEFAULT_CONFIG
from zero.integrations.unsupported import UnsupportedFeatureError

from models import one_thread  # noqa: F401  (autouse fixture)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("config, kwargs, dtype", [
    (None, dict(mp_size=1, dtype=torch.float, replace_with_kernel_inject=False), torch.float32),  # test-bert.py's
    (None, dict(tensor_parallel={"tp_size": 1}), torch.float16),  # DeepSpeed's default dtype
    ({"dtype": torch.float, "tensor_parallel": {"tp_size": 1}}, {}, torch.float32),
    ({"dtype": "bf16", "tp": {"tp_size": 1}, "kernel_inject": False, "max_tokens": 64}, dict(dtype="bf16"),
     torch.bfloat16),
])
def test_deepspeeds_arguments_run(config, kwargs, dtype):
    plain = model()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    engine = zero.init_inference(model(), config, **kwargs)
    try:
        assert engine.compute_dtype == dtype
        out = engine(x.to(dtype))
        expected = plain.to(dtype)(x.to(dtype))
        assert out.dtype == dtype and torch.equal(out, expected)
    finally:
        engine.close()


def test_the_engine_carries_the_models_config_as_deepspeeds():
    """DeepSpeed's InferenceEngine.config is the model's config (text-generation's inference-test.py reads
    `pipe.model.config` for its figures: an AttributeError before)."""
    with_config, without = model(), model()
    with_config.config = {"hidden_size": 8}
    engines = [zero.init_inference(m, dtype=torch.float) for m in (with_config, without)]
    try:
        assert engines[0].config is with_config.config and engines[1].config is None
    finally:
        for engine in engines:
            engine.close()


def test_an_inference_config_file(tmp_path):
    path = tmp_path / "inference.json"
    path.write_text(json.dumps({"dtype": "fp32", "replace_with_kernel_inject": False,
                                "zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}}))
    engine = zero.init_inference(model(), str(path))
    try:
        assert engine.compute_dtype == torch.float32 and engine.swap.store is not None  # the weights went to nvme
    finally:
        engine.close()


@pytest.mark.parametrize("kwargs, feature, instead", [
    (dict(mp_size=2), "init_inference(mp_size=2)", "there is no tensor, model or sequence parallelism"),
    (dict(tensor_parallel={"tp_size": 2}), "init_inference(tensor_parallel={'tp_size': 2})", "no tensor"),
    (dict(replace_with_kernel_inject=True), "init_inference(replace_with_kernel_inject=True)",
     "there is no kernel injection"),
    (dict(kernel_inject=True), "init_inference(kernel_inject=True)", "there is no kernel injection"),
    (dict(checkpoint="checkpoints.json"), "init_inference(checkpoint='checkpoints.json')", "weights=DIR"),
    (dict(dtype=torch.int8), "init_inference(dtype=torch.int8)", "int8 inference kernels are absent"),
    (dict(enable_cuda_graph=True), "init_inference(enable_cuda_graph=True)", "CUDA graph capture is absent"),
])
def test_features_not_here_are_named(kwargs, feature, instead):
    with pytest.raises(UnsupportedFeatureError) as error:
        deepspeed_config.ours(None, kwargs, DEFAULT_CONFIG)
    assert error.value.feature == feature and instead in error.value.instead


@pytest.mark.parametrize("config, kwargs, key, words", [
    ({"dtyp": "fp16"}, {}, "dtyp", "neither a key of DeepSpeed's inference config"),
    ({"dtype": torch.float}, dict(dtype=torch.half), "dtype", "given in config as torch.float32 and as an argument"),
    ({"tp": {"tp_size": 1}}, dict(tensor_parallel={"tp_size": 1}), "tensor_parallel", "names the same setting as tp"),
    ({"tensor_parallel": {"size": 1}}, {}, "tensor_parallel.size", "not a key of DeepSpeed's tensor_parallel"),
    ({"dtype": torch.float64}, {}, "dtype", "DeepSpeed's inference dtypes"),
    ({"zero": {"stage": 3, "offload_param": {"device": "disk"}}}, {}, "zero.offload_param.device", ""),
    ({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}, dict(dtype=torch.half), "dtype",
     "not with a training-format config"),
])
def test_bad_keys_are_named(config, kwargs, key, words):
    with pytest.raises(ConfigError) as error:
        deepspeed_config.ours(config, kwargs, DEFAULT_CONFIG)
    assert error.value.key == key and words in str(error.value), str(error.value)


def test_our_config_and_none_pass_through():
    ours = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    assert deepspeed_config.ours(ours, {}, DEFAULT_CONFIG) is ours
    assert deepspeed_config.ours(None, {}, DEFAULT_CONFIG) is DEFAULT_CONFIG
    kernels_only = deepspeed_config.ours({"triangular_masking": False, "moe": True, "keep_module_on_host": True,
                                          "dtype": torch.float}, {}, DEFAULT_CONFIG)
    assert kernels_only == DEFAULT_CONFIG  # read only by what is not here: nothing changes
