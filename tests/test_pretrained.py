"""Pretrained weights straight into the tiers (`zero.initialize(..., weights=DIR)`): a model built on meta takes a
`save_pretrained` checkpoint (one file or shards) or our export unit by unit, its first forward equal to the
in-memory model's, and a checkpoint that does not fit the model is named."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import zero
from zero.params.pretrained import PretrainedWeightsError

from checkpoint_models import ds_config
from conftest import child_env
from models import one_thread  # noqa: F401  (autouse fixture)

IDS = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))


def gpt2_config(**overrides):
    from transformers import GPT2Config

    return GPT2Config(**{"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 97, "n_positions": 32,
                         "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **overrides})


def llama_config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97, **overrides})


def saved(config, path, seed: int = 0, **save_options):
    """A transformers causal LM with random weights, saved with save_pretrained; returns it (in memory)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path, **save_options)
    return model


def on_meta(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("kind, stage, offload, shards", [
    ("gpt2", 3, "nvme", False), ("llama", 3, "nvme", True), ("gpt2", 3, "cpu", True), ("llama", 0, "cpu", False)])
def test_weights_load_into_the_tiers_and_the_first_forward_is_exact(kind, stage, offload, shards, tmp_path):
    config = gpt2_config() if kind == "gpt2" else llama_config()
    options = {"max_shard_size": "20KB"} if shards else {}
    reference = saved(config, tmp_path / "model", **options)
    assert os.path.exists(tmp_path / "model" / "model.safetensors.index.json") == shards
    engine = zero.initialize(model=on_meta(config), config=ds_config(stage, "fp32", offload, str(tmp_path)),
                             weights=tmp_path / "model")[0]
    try:
        engine.eval()
        with torch.no_grad():
            ours, theirs = engine(IDS).logits, reference(IDS).logits
        assert torch.equal(ours, theirs)
    finally:
        engine.close()


def test_a_checkpoint_holding_both_names_of_a_tied_weight_loads(tmp_path):
    """A full state_dict saved as it is (GPT-2's lm_head.weight beside transformer.wte.weight), as from_pretrained
    reads it: the second name is the same tensor, not one the model has no place for."""
    from safetensors.torch import save_file

    reference = saved(gpt2_config(), tmp_path / "model")
    state = {k: v.contiguous().clone() for k, v in reference.state_dict().items()}
    assert "lm_head.weight" in state and "transformer.wte.weight" in state
    (tmp_path / "full").mkdir()
    save_file(state, tmp_path / "full" / "model.safetensors", metadata={"format": "pt"})
    engine = zero.initialize(model=on_meta(gpt2_config()), config=ds_config(3, "fp32", "cpu", str(tmp_path)),
                             weights=tmp_path / "full")[0]
    try:
        engine.eval()
        with torch.no_grad():
            assert torch.equal(engine(IDS).logits, reference(IDS).logits)
    finally:
        engine.close()


def test_our_export_loads_back(tmp_path):
    from transformers import AutoModelForCausalLM

    config = gpt2_config()
    torch.manual_seed(0)
    engine = zero.initialize(model=AutoModelForCausalLM.from_config(config),
                             config=ds_config(3, "fp32", "cpu", str(tmp_path)))[0]
    engine.save_checkpoint(tmp_path / "ckpt")
    expected = {k: v.clone() for k, v in engine.module_state_dict().items()}
    engine.close()
    from zero.export import export_fp32

    export_fp32(tmp_path / "ckpt", tmp_path / "export")
    engine = zero.initialize(model=on_meta(config), config=ds_config(3, "fp32", "nvme", str(tmp_path)),
                             weights=tmp_path / "export")[0]
    try:
        loaded = engine.module_state_dict()
        assert loaded.keys() == expected.keys()
        assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    finally:
        engine.close()


def test_a_checkpoint_that_does_not_fit_the_model_is_named(tmp_path):
    saved(gpt2_config(), tmp_path / "model", max_shard_size="20KB")
    config = ds_config(3, "fp32", "cpu", str(tmp_path))
    with pytest.raises(PretrainedWeightsError, match=r"transformer\.wte\.weight.*shape \[97, 32\].*\[97, 64\]"):
        zero.initialize(model=on_meta(gpt2_config(n_embd=64)), config=config, weights=tmp_path / "model")
    with pytest.raises(PretrainedWeightsError, match=r"no tensor for the model's 'transformer\.h\.2\.ln_1\.weight'"):
        zero.initialize(model=on_meta(gpt2_config(n_layer=3)), config=config, weights=tmp_path / "model")
    with pytest.raises(PretrainedWeightsError, match=r"2 tensors the model has no parameter or buffer for"):
        zero.initialize(model=on_meta(gpt2_config(n_layer=1)), config=config, weights=tmp_path / "model")
    index = json.loads((tmp_path / "model" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    data = (tmp_path / "model" / shard).read_bytes()
    (tmp_path / "model" / shard).write_bytes(data[: len(data) // 2])
    with pytest.raises(PretrainedWeightsError, match=rf"{shard}' is truncated: tensor"):
        zero.initialize(model=on_meta(gpt2_config()), config=config, weights=tmp_path / "model")
    os.unlink(tmp_path / "model" / shard)
    with pytest.raises(PretrainedWeightsError, match=rf"shard '.*{shard}' is missing: it holds"):
        zero.initialize(model=on_meta(gpt2_config()), config=config, weights=tmp_path / "model")
    with pytest.raises(PretrainedWeightsError, match="no such file or directory"):
        zero.initialize(model=on_meta(gpt2_config()), config=config, weights=tmp_path / "nowhere")


DEVICE_BUDGET = 16 << 20
"""Above the least device budget of the model below (14.2 MiB: zero.initialize.device_need)."""
CHILD = r"""
import json, resource, sys, torch, zero
from transformers import AutoModelForCausalLM, GPT2Config
config = GPT2Config(**json.loads(sys.argv[1]))
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(config)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
engine = zero.initialize(model=model, config=json.loads(sys.argv[2]), weights=sys.argv[3])[0]
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
largest = max(unit.flat.padded_numel for unit in engine.units) * 4
print(json.dumps({"growth": after - before, "largest_unit": largest, "pool_peak": engine.swap.pool.peak_in_use}))
engine.close()
"""


def test_loading_holds_one_unit_at_a_time(tmp_path):
    """The weights (~76 MB) are 4x the host budget (~19 MB); loading them grows the process by the host budget,
    the device budget and a few copies of the largest unit (materialized, flattened, cast), never by the
    model."""
    shape = {"n_layer": 24, "n_embd": 256, "n_head": 4, "vocab_size": 1024, "n_positions": 64}
    saved(gpt2_config(**shape), tmp_path / "model")
    weights = os.path.getsize(tmp_path / "model" / "model.safetensors")
    budget = weights // 4
    config = ds_config(3, "fp32", "nvme", str(tmp_path))
    config["zero_tiering"] = {"host_budget": budget, "device_budget": DEVICE_BUDGET}
    config["zero_optimization"]["sub_group_size"] = 1 << 20
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(shape), json.dumps(config),
                           str(tmp_path / "model")], env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["pool_peak"] <= budget
    bound = budget + DEVICE_BUDGET + 4 * report["largest_unit"] + (32 << 20)
    assert report["growth"] <= bound < weights + budget, report
