"""Inference from the tiers (`zero.init_inference`): greedy generation from weights in host memory or on nvme is
token for token the in-memory model's, weights far larger than the host budget load and run within it, and a
config or checkpoint that cannot serve is named."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import zero
from zero.cli import run_command
from zero.config import ConfigError
from zero.params.pretrained import PretrainedWeightsError

from conftest import child_env
from models import one_thread  # noqa: F401  (autouse fixture)
from test_pretrained import gpt2_config, llama_config, on_meta, saved

PROMPT = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(5))


def inference_config(offload: str, nvme_path, **tiering) -> dict:
    zero_opt = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": {"device": offload}}
    if offload == "nvme":
        zero_opt["offload_param"]["nvme_path"] = str(nvme_path)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero_opt}
    if tiering:
        config["zero_tiering"] = tiering
    return config


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_greedy_generation_is_the_in_memory_models(kind, offload, tmp_path):
    config = gpt2_config() if kind == "gpt2" else llama_config()
    reference = saved(config, tmp_path / "model")
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = reference.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), **options)
    engine = zero.init_inference(on_meta(config), inference_config(offload, tmp_path), weights=tmp_path / "model")
    try:
        tokens = engine.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), **options)
        assert torch.equal(tokens, expected)
        assert not any(unit.gathered for unit in engine.placement.units), "a unit stayed gathered"
        if offload == "nvme":
            assert engine.swap.stats.bytes_moved["nvme->host"] > 0, "the weights never came from nvme"
        assert not any(p.requires_grad for p in engine.module.parameters())
    finally:
        engine.close()


def test_without_a_config_weights_stay_in_host_memory_and_dropout_is_off(tmp_path):
    dropout = gpt2_config(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)  # built on meta in training mode
    reference = saved(dropout, tmp_path / "model")
    engine = zero.init_inference(on_meta(dropout), weights=tmp_path / "model")
    try:
        assert torch.equal(engine(PROMPT).logits, reference(PROMPT).logits)
        assert engine.swap.store is None
    finally:
        engine.close()


def test_a_backward_through_an_inference_engine_is_refused_and_leaves_nothing_gathered(tmp_path):
    """Its units have no gradient path to release them after a backward: a forward with gradients through the
    module (input saliency, say) may run, its backward is an error."""
    reference = saved(llama_config(), tmp_path / "model")
    engine = zero.init_inference(on_meta(llama_config()), weights=tmp_path / "model")
    try:
        embeds = reference.get_input_embeddings()(PROMPT).detach().requires_grad_()
        logits = engine.module(inputs_embeds=embeds).logits
        with pytest.raises(RuntimeError, match="an inference engine runs forwards only"):
            logits.sum().backward()
        assert all(unit.refs == 0 and not unit.gathered for unit in engine.placement.units)
        assert torch.equal(engine(PROMPT).logits, reference(PROMPT).logits)
    finally:
        engine.close()


def test_what_cannot_serve_is_named(tmp_path):
    saved(gpt2_config(), tmp_path / "model")
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        zero.init_inference(on_meta(gpt2_config()), {"train_micro_batch_size_per_gpu": 1,
                                                    "zero_optimization": {"stage": 2}})
    with pytest.raises(PretrainedWeightsError, match=r"transformer\.wte\.weight.*shape \[97, 32\].*\[97, 64\]"):
        zero.init_inference(on_meta(gpt2_config(n_embd=64)), weights=tmp_path / "model")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    with pytest.raises(ConfigError, match=r"zero_tiering.host_budget.*largest parameter shard.*raise it to at least"):
        zero.init_inference(on_meta(gpt2_config()), inference_config("nvme", nvme, host_budget=4096),
                            weights=tmp_path / "model")
    assert not any(nvme.iterdir())  # nothing left in the store's directory
    os.unlink(tmp_path / "model" / "model.safetensors")
    with pytest.raises(PretrainedWeightsError, match="holds neither model.safetensors"):
        zero.init_inference(on_meta(gpt2_config()), weights=tmp_path / "model")


def test_the_least_host_budget_is_enough(tmp_path):
    """At exactly `host_need` (the largest shard: a tied embedding three times a block's) every forward of a
    generation finds room: a gather that meets the room still pinned by a shard whose copy is under way waits for
    its release (before, most such runs failed: the embedding's shard pinned, the next block's asked)."""
    from zero.inference.engine import host_need

    shape = {"n_layer": 4, "n_embd": 128, "n_head": 2, "vocab_size": 4096, "n_positions": 32}
    reference = saved(gpt2_config(**shape), tmp_path / "model")
    config = inference_config("nvme", tmp_path)
    config["zero_tiering"] = {"host_budget": host_need(on_meta(gpt2_config(**shape)), config)}
    for _ in range(2):
        engine = zero.init_inference(on_meta(gpt2_config(**shape)), config, weights=tmp_path / "model")
        try:
            prompt = torch.tensor([[5, 17, 42]])
            new = engine.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
            assert torch.equal(new, reference.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0))
            assert engine.swap.pool.peak_in_use <= config["zero_tiering"]["host_budget"]
        finally:
            engine.close()


CHILD = r"""
import json, resource, sys, torch, zero
from transformers import AutoModelForCausalLM, GPT2Config
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(GPT2Config(**json.loads(sys.argv[1])))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
engine = zero.init_inference(model, json.loads(sys.argv[2]), weights=sys.argv[3])
engine.generate(torch.zeros(1, 4, dtype=torch.long), max_new_tokens=4, do_sample=False, pad_token_id=0)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
largest = max(unit.flat.padded_numel for unit in engine.placement.units) * 4
print(json.dumps({"growth": after - before, "largest_unit": largest, "pool_peak": engine.swap.pool.peak_in_use,
                  "read": engine.swap.stats.bytes_moved["nvme->host"]}))
engine.close()
"""


def test_weights_four_times_the_host_budget_generate_within_it(tmp_path):
    """~76 MB of weights, a ~19 MB host budget: loading and generating grow the process by the budget, the device
    budget and a few copies of the largest unit, never by the model; every token reads the weights again."""
    shape = {"n_layer": 24, "n_embd": 256, "n_head": 4, "vocab_size": 1024, "n_positions": 64}
    saved(gpt2_config(**shape), tmp_path / "model")
    weights = os.path.getsize(tmp_path / "model" / "model.safetensors")
    budget = weights // 4
    config = inference_config("nvme", tmp_path, host_budget=budget, device_budget=8 << 20)
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(shape), json.dumps(config),
                           str(tmp_path / "model")], env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["pool_peak"] <= budget and report["read"] >= 4 * (weights - budget)
    bound = budget + (8 << 20) + 4 * report["largest_unit"] + (32 << 20)
    assert report["growth"] <= bound < weights + budget, report


def test_weights_on_nvme_read_ahead_the_bucket_and_cache_the_rest_of_the_budget(tmp_path):
    """No optimizer state, so no read-ahead for it: prefetch reads the prefetch bucket ahead and the rest of the
    host budget keeps weights from one forward to the next, so a forward reads less than the weights."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config(n_layer=8, n_embd=128, n_head=2, vocab_size=512, n_positions=32))
    weights = sum(p.numel() * 4 for p in model.parameters())
    bucket = 100_000  # parameters
    config = inference_config("nvme", tmp_path, host_budget=weights // 2)
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = bucket
    engine = zero.init_inference(model, config)
    try:
        assert engine.swap.config.prefetch_bytes == 4 * bucket
        largest = max(unit.nbytes for unit in engine.placement.units)
        reads = []
        for _ in range(4):  # the first forward records the trace the others follow
            before = engine.swap.stats.bytes_moved["nvme->host"]
            engine(PROMPT)
            reads.append(engine.swap.stats.bytes_moved["nvme->host"] - before)
    finally:
        engine.close()
    cached = weights // 2 - 4 * bucket - 2 * largest  # the budget less the read-ahead and the units in use
    assert reads[0] >= weights and cached > 0  # all of it (shards padded), the first time
    assert all(read <= reads[0] - cached for read in reads[1:]), (reads, cached)


def test_the_command_generates_what_the_model_in_memory_does(tmp_path, capsys):
    from zero.inference.__main__ import main

    reference = saved(gpt2_config(), tmp_path / "model")
    prompt = [5, 17, 42]
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    new = main(["--model", str(tmp_path / "model"), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens",
                "6", "--offload", "nvme", "--nvme-path", str(tmp_path / "nvme")])
    assert new == expected[0, len(prompt):].tolist()
    out = capsys.readouterr().out
    assert f"token ids: {new}" in out and "decode" in out and "read from nvme" in out
    twice = tmp_path / "twice.json"
    twice.write_text('{"train_micro_batch_size_per_gpu": 1, "train_micro_batch_size_per_gpu": 2}')
    for args, message in ((["--model", str(tmp_path)], "ValueError: --model"),
                          (["--model", str(tmp_path / "model"), "--host-budget", "lots"],
                           "ValueError: --host-budget 'lots': expected a size"),
                          (["--model", str(tmp_path / "model"), "--prompt-ids", "5,9999"], "ValueError: prompt token"),
                          (["--model", str(tmp_path / "model"), "--prompt-ids", "1,a"], "ValueError: --prompt-ids '1,a'"),
                          (["--model", str(tmp_path / "model"), "--prompt", ""], "ValueError: the prompt is empty"),
                          (["--model", str(tmp_path / "model"), "--offload", "nvme", "--nvme-path", str(twice)],
                           "ValueError: --nvme-path .* is not a directory"),
                          (["--model", str(tmp_path / "model"), "--config", str(twice)],
                           "ConfigError: train_micro_batch_size_per_gpu: appears twice")):
        args = [*args, "--prompt-ids", "1"] if "--prompt-ids" not in args and "--prompt" not in args else args
        with pytest.raises(SystemExit) as info:  # as the shell runs it: one line, the error's type, status 1
            run_command("zero.inference", main, args, errors=(ValueError,))
        err = capsys.readouterr().err
        assert info.value.code == 1 and re.match(f"zero.inference: {message}", err) and err.count("\n") == 1, err
    with pytest.raises(ValueError, match="no config.json there"):  # --debug: the traceback
        run_command("zero.inference", main, ["--model", str(tmp_path), "--prompt-ids", "1", "--debug"],
                    errors=(ValueError,))
