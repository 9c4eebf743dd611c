"""What `python -m zero.launch` gives a DeepSpeed script beyond `deepspeed`'s modules being `zero`'s: DeepSpeed's
helpers by their paths (the names real DeepSpeedExamples scripts import), transformers' HfDeepSpeedConfig as our
HfZeroConfig (DeepSpeed-Chat's ZeRO-3 model build), and, where code checks for the deepspeed package itself
(accelerate's DeepSpeed plugin, importlib.metadata), the error followed by what to use instead."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from conftest import child_env
from stage3_models import free_port


def launch(tmp_path, script: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "script.py").write_text(textwrap.dedent(script))
    return subprocess.run([sys.executable, "-m", "zero.launch", "--no_local_rank", "--master_port", str(free_port()),
                           str(tmp_path / "script.py"), *args], env={**child_env(), "OMP_NUM_THREADS": "1"},
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)


NAMES = """
    import deepspeed, torch
    from deepspeed.utils import RepeatingLoader, logger, set_z3_leaf_modules
    from deepspeed.utils.logging import log_dist
    from deepspeed.runtime.utils import see_memory_usage
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
    from deepspeed import DeepSpeedConfig
    from deepspeed.ops.op_builder import AsyncIOBuilder
    from deepspeed.ops.sparse_attention import FixedSparsityConfig
    from deepspeed.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd
    from deepspeed.sequence.layer import DistributedAttention
    from deepspeed.comm import TorchBackend
    import deepspeed.module_inject as module_inject

    deepspeed.runtime.utils.set_random_seed(1)
    assert next(RepeatingLoader([7])) == 7 and OffloadDeviceEnum.cpu == "cpu"
    assert DeepSpeedConfig({"train_micro_batch_size_per_gpu": 2}).train_batch_size == 2
    assert deepspeed.__version__ == "0.19.8" and deepspeed.__version_minor__ == 19  # scripts check it
    for stand_in in (AsyncIOBuilder, FixedSparsityConfig, convert_to_random_ltd, DistributedAttention, TorchBackend,
                     module_inject.replace_transformer_layer):
        try:
            stand_in()
        except NotImplementedError as error:
            print(type(error).__name__, error.feature)
"""


def test_deepspeeds_helpers_import_by_their_paths(tmp_path):
    done = launch(tmp_path, NAMES)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [f"UnsupportedFeatureError deepspeed.{name}" for name in (
        "ops.op_builder.AsyncIOBuilder", "ops.sparse_attention.FixedSparsityConfig",
        "runtime.data_pipeline.data_routing.helper.convert_to_random_ltd", "sequence.layer.DistributedAttention",
        "comm.TorchBackend", "module_inject.replace_transformer_layer")]


HF_CONFIG = """
    import sys, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig as Lazy
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, is_deepspeed_zero3_enabled
    import deepspeed
    from zero.integrations.hf_config import HfZeroConfig

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(sys.argv[1])
    assert HfDeepSpeedConfig is HfZeroConfig and Lazy is HfZeroConfig
    dschf = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    assert is_deepspeed_zero3_enabled()
    model = LlamaForCausalLM.from_pretrained(sys.argv[1])
    partitioned = [p for p in model.parameters() if hasattr(p, "ds_id")]
    assert partitioned and all(p.ds_status == deepspeed.zero.ZeroParamStatus.NOT_AVAILABLE for p in partitioned)
    print("PARTITIONED", len(partitioned))
"""


def test_transformers_hfdeepspeedconfig_is_ours(tmp_path):
    """DeepSpeed-Chat's create_hf_model at ZeRO-3: transformers' HfDeepSpeedConfig, then from_pretrained (before: a
    PackageNotFoundError, 'deepspeed>=0.9.3' not installed)."""
    done = launch(tmp_path, HF_CONFIG, str(tmp_path / "model"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().startswith("PARTITIONED ")


ACCELERATE = """
    from accelerate import Accelerator, DeepSpeedPlugin
    Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
"""


@pytest.mark.parametrize("script, first", [
    (ACCELERATE, "ImportError: DeepSpeed is not installed"),
    ("import importlib.metadata; importlib.metadata.version('deepspeed')", "PackageNotFoundError"),
])
def test_a_check_for_the_deepspeed_package_points_to_what_to_use(tmp_path, script, first):
    done = launch(tmp_path, script)
    assert done.returncode != 0
    assert first in done.stderr, done.stderr[-3000:]  # the check's own error, then ours
    assert "zero.integrations.deepspeed_alias.PackageAskedError: `deepspeed` in this process is zero-tiering's " \
           "alias" in done.stderr and 'README.md, "From Accelerate"' in done.stderr, done.stderr[-3000:]


def test_a_name_the_alias_lacks_stays_its_import_error(tmp_path):
    done = launch(tmp_path, "from deepspeed.utils import no_such_name")
    assert done.returncode != 0
    assert "ImportError: cannot import name 'no_such_name' from 'deepspeed.utils'" in done.stderr
    assert "PackageAskedError" not in done.stderr
