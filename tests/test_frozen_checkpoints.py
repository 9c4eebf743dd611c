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


TWO_RANKS = """
import os, sys, json, pathlib, torch, torch.distributed as dist, peft
sys.path.insert(0, {tests!r})
from transformers import TrainingArguments
from safetensors.torch import load_file
from test_hf_trainer import dataset, hf_docs_zero3, training_args
from test_frozen import lora_on
from stage3_models import tiny_llama
from zero.integrations import ZeroTrainer
root = pathlib.Path({root!r})
model = lora_on(tiny_llama(0, vocab_size=256))
args = training_args(TrainingArguments, root / "out", max_steps=3, ddp_backend="gloo")
trainer = ZeroTrainer(model=model, train_dataset=dataset(48), args=args,
                      zero_config=hf_docs_zero3(root / f"nvme{{os.environ['RANK']}}"))
trainer.train()
trainer.save_model(str(root / "ours"))
model.save_pretrained(root / "peft")  # PEFT's own call, on every rank (its state_dict gathers)
ids = dataset(1)[0]["input_ids"][None]
trainer.engine.eval()
with torch.no_grad():
    loss = trainer.engine(input_ids=ids, labels=ids).loss.item()
trainer.close()
if dist.get_rank() == 0:
    ours, theirs = (load_file(root / d / "adapter_model.safetensors") for d in ("ours", "peft"))
    reloaded = peft.PeftModel.from_pretrained(tiny_llama(0, vocab_size=256), root / "ours").eval()
    with torch.no_grad():
        again = reloaded(input_ids=ids, labels=ids).loss.item()
    print(json.dumps(dict(keys=sorted(ours), same=sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k])
                                                                                     for k in ours),
                          trained=all(bool(v.any()) for k, v in ours.items() if "lora_B" in k),
                          files=sorted(os.listdir(root / "ours")), loss=loss, again=again)))
"""


def test_two_ranks_save_the_adapters_peft_saves_and_they_reload_onto_a_fresh_base(tmp_path):
    """ZeroTrainer on two ranks (gloo): save_model writes the adapters alone, the same as PEFT's own save_pretrained
    called on every rank, and a fresh base with them computes the engine's loss."""
    from conftest import child_env
    from stage3_models import free_port

    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS.format(tests=os.path.dirname(os.path.abspath(__file__)), root=str(tmp_path)))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(script)], cwd=tmp_path, env=child_env() | {"OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["keys"] and all("lora_" in k for k in result["keys"]) and result["same"] and result["trained"]
    assert "model.safetensors" not in result["files"] and "adapter_config.json" in result["files"]
    assert abs(result["again"] - result["loss"]) <= 1e-6
