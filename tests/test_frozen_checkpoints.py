"""Frozen parameters in checkpoints: one saved without the base resumes bitwise in a fresh process on the same
base, one saved with it restores the base, and ZeroTrainer saves a PEFT model's adapters alone (PEFT's files) and
resumes from its checkpoint-N. The models and helpers are test_frozen.py's."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import peft
import torch

import zero as deepspeed

from stage3_models import (REPO_ROOT, assert_state_equal, batches, engine_train, full_state, one_thread, stage3_config,
                           tiny_llama)
from test_frozen import ACCUM, CLIP, lora, lora_on, trainable

RESUME = """
import sys, torch, peft
sys.path.insert(0, {tests!r})
import zero as deepspeed
from test_frozen import lora, trainable, frozen_writes
from stage3_models import batches, engine_train, full_state, stage3_config
torch.set_num_threads(1)
model = lora("llama")
engine, *_ = deepspeed.initialize(model=model, config=stage3_config("nvme", "nvme", nvme_path={nvme!r}, accum=2, clip=1.0),
                                  model_parameters=trainable(model))
engine.load_checkpoint({ckpt!r})
written = frozen_writes(engine)
losses = engine_train(engine, batches(8)[4:])
torch.save({{"losses": losses, "state": full_state(engine), "writes": frozen_writes(engine) - written}}, {out!r})
engine.close()
"""


def test_a_checkpoint_without_the_base_resumes_bitwise_in_a_fresh_process(tmp_path):
    data = batches(8)
    with one_thread():
        model = lora("llama")
        config = stage3_config("nvme", "nvme", nvme_path=tmp_path / "a", accum=ACCUM, clip=CLIP)
        (tmp_path / "a").mkdir()
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=trainable(model))
        try:
            first = engine_train(engine, data[:4])
            engine.save_checkpoint(tmp_path / "ckpt", tag="lora", exclude_frozen_parameters=True)
            rest = engine_train(engine, data[4:])
            uninterrupted = full_state(engine)
        finally:
            engine.close()
    with open(tmp_path / "ckpt" / "lora" / "manifest.json") as f:
        excluded = json.load(f)["excluded"]
    assert set(excluded) == {n for n, p in lora("llama").named_parameters() if not p.requires_grad}
    data_bytes = sum(os.path.getsize(tmp_path / "ckpt" / "lora" / n) for n in os.listdir(tmp_path / "ckpt" / "lora"))
    base_bytes = 4 * sum(p.numel() for p in lora("llama").parameters() if not p.requires_grad)
    assert data_bytes < base_bytes  # the base is not in it
    (tmp_path / "b").mkdir()
    script = RESUME.format(tests=os.path.join(REPO_ROOT, "tests"), nvme=str(tmp_path / "b"),
                           ckpt=str(tmp_path / "ckpt"), out=str(tmp_path / "resumed.pt"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = torch.load(tmp_path / "resumed.pt")
    assert first and resumed["losses"] == rest
    assert resumed["writes"] == 0  # the load left the base as the engine stored it
    assert_state_equal(resumed["state"], uninterrupted)


def test_a_full_checkpoint_restores_the_base_too(tmp_path):
    """Without exclusion the frozen parameters are saved by name, whole: a model whose base differs takes the
    saved one on load."""
    data = batches(2)
    with one_thread():
        model = lora("llama")
        config = stage3_config("cpu", "cpu", accum=1)
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=trainable(model))
        try:
            engine_train(engine, data)
            engine.save_checkpoint(tmp_path, tag="full")
            saved = full_state(engine)
        finally:
            engine.close()
        other = lora("llama", seed=1)
        engine, *_ = deepspeed.initialize(model=other, config=config, model_parameters=trainable(other))
        try:
            assert not torch.equal(full_state(engine)["base_model.model.model.embed_tokens.weight"],
                                   saved["base_model.model.model.embed_tokens.weight"])
            engine.load_checkpoint(tmp_path, tag="full")
            assert_state_equal(full_state(engine), saved)
        finally:
            engine.close()


def test_zero_trainer_saves_a_peft_models_adapters_alone_and_resumes_from_its_checkpoint(tmp_path):
    """ZeroTrainer with a PEFT model: `save_model` writes PEFT's adapter files (no base), which PeftModel.from_pretrained
    loads onto a fresh base to compute the engine's loss; its checkpoint-N leaves the base out, and training resumed
    from it continues as the uninterrupted run."""
    from transformers import TrainingArguments

    from test_hf_trainer import dataset, hf_docs_zero3, losses, training_args
    from zero.integrations import ZeroTrainer

    def trainer_of(out, **overrides):
        model = lora_on(tiny_llama(0, vocab_size=256))
        args = training_args(TrainingArguments, out, max_steps=6, **overrides)
        return ZeroTrainer(model=model, train_dataset=dataset(48), args=args,
                           zero_config=hf_docs_zero3(tmp_path / "nvme", accumulation="micro-batch")), model

    with one_thread():
        whole, model = trainer_of(tmp_path / "whole")
        try:
            whole.train()
            whole.save_model(str(tmp_path / "adapter"))
            ids = dataset(1)[0]["input_ids"][None]
            whole.engine.eval()
            with torch.no_grad():
                trained_loss = whole.engine(input_ids=ids, labels=ids).loss.item()
        finally:
            whole.close()
        files = set(os.listdir(tmp_path / "adapter"))
        assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files
        reloaded = peft.PeftModel.from_pretrained(tiny_llama(0, vocab_size=256), tmp_path / "adapter").eval()
        with torch.no_grad():
            assert abs(reloaded(input_ids=ids, labels=ids).loss.item() - trained_loss) <= 1e-6

        first, _ = trainer_of(tmp_path / "run", save_strategy="steps", save_steps=3)
        try:
            first.train()
        finally:
            first.close()
        checkpoint = tmp_path / "run" / "checkpoint-3"
        with open(checkpoint / "global_step3" / "manifest.json") as f:
            assert "base_model.model.model.embed_tokens.weight" in json.load(f)["excluded"]
        resumed, _ = trainer_of(tmp_path / "resumed")
        try:
            resumed.train(resume_from_checkpoint=str(checkpoint))
            after = {k: v for k, v in losses(resumed).items() if k > 3}
            assert len(after) == 3 and after == {k: v for k, v in losses(first).items() if k > 3}
        finally:
            resumed.close()
