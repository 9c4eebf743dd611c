"""PEFT's LoRA (the `peft` package) on a small Llama built under zero.Init and trained by our engine with ZeRO-3,
parameters and optimizer state on nvme: PEFT counts the partitioned model's parameters from `ds_numel`, the adapter
trains, and `save_pretrained` / `PeftModel.from_pretrained` (PEFT's own calls) give back the trained adapter: a
fresh base model with it loaded computes the engine's loss. ZeroTrainer.save_model writes what PEFT's own
save_pretrained writes: every adapter (an inactive one too) and the embedding weights PEFT saves beside them.
"""
from __future__ import annotations

import os
import warnings

import peft
import pytest
import torch

import zero as deepspeed

from stage3_models import batches, one_thread, tiny_llama  # noqa: F401


def test_peft_lora_trains_under_zero3_and_its_adapter_saves_and_reloads(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    offload = {"device": "nvme", "nvme_path": str(nvme)}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "offload_param": offload, "offload_optimizer": offload}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        base = tiny_llama(0)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, lora)
    trainable, total = model.get_nb_trainable_parameters()
    plain = peft.get_peft_model(tiny_llama(0), lora)
    assert (trainable, total) == plain.get_nb_trainable_parameters()  # read from ds_numel where partitioned
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    ids = batches(1)[0]
    losses = []
    for _ in range(8):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    engine.eval()
    with torch.no_grad():
        trained_loss = engine(input_ids=ids, labels=ids).loss.item()
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    with deepspeed.zero.GatheredParameters(list(adapters.values())):
        trained = {n: p.detach().clone() for n, p in adapters.items()}
    model.save_pretrained(tmp_path / "adapter")
    engine.close()

    reloaded = peft.PeftModel.from_pretrained(tiny_llama(0), tmp_path / "adapter")
    for name, p in reloaded.named_parameters():
        if "lora_" in name:
            key = name if name in trained else name.replace(".default", "")
            assert torch.equal(p, trained[name]), key
    reloaded.eval()
    with torch.no_grad():
        assert abs(reloaded(input_ids=ids, labels=ids).loss.item() - trained_loss) <= 1e-6


def _two_adapters(tmp_path):
    """'default' trained, 'ref' added and left inactive: its parameters are frozen, in frozen units."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                           init_lora_weights=False)  # B not zero: 'ref' has values of its own
    model = peft.get_peft_model(tiny_llama(0, vocab_size=256), lora)
    model.add_adapter("ref", lora)
    model.set_adapter("default")
    return model


def _embedding_targeted(tmp_path):
    """PEFT saves the embedding's base weight with an adapter that targets it."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "embed_tokens"])
    return peft.get_peft_model(tiny_llama(0, vocab_size=256), lora)


def _resized_vocabulary(tmp_path):
    """PEFT saves the resized embedding and head (their new rows are in no base) beside the adapter."""
    from transformers import LlamaForCausalLM

    tiny_llama(0, vocab_size=256).save_pretrained(tmp_path / "base")
    base = LlamaForCausalLM.from_pretrained(tmp_path / "base")
    base.resize_token_embeddings(264, mean_resizing=False)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj"]))


def _adapter_files(root) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return {os.path.relpath(d, root): load_file(os.path.join(d, f)) for d, _, files in os.walk(root)
            for f in files if f == "adapter_model.safetensors"}


@pytest.mark.parametrize("build", [_two_adapters, _embedding_targeted, _resized_vocabulary])
def test_zero_trainer_saves_what_peft_save_pretrained_saves(tmp_path, build):
    """Every adapter_model.safetensors PEFT's save_pretrained writes (the engine's model through PEFT's own call,
    its state_dict gathered whole), with the same keys and values; and the keys a plain model of the same build
    saves."""
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    from test_hf_trainer import dataset, hf_docs_zero3, training_args
    from zero.integrations import ZeroTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's notes on saving the embedding layers
        build(tmp_path).save_pretrained(tmp_path / "plain")
        trainer = ZeroTrainer(model=build(tmp_path), train_dataset=dataset(8),
                              zero_config=hf_docs_zero3(tmp_path / "nvme"),
                              args=training_args(TrainingArguments, tmp_path / "out", max_steps=1))
        try:
            trainer.train()
            trainer.save_model(str(tmp_path / "ours"))
            trainer.model.save_pretrained(tmp_path / "peft")
        finally:
            trainer.close()
    ours, theirs, plain = (_adapter_files(tmp_path / d) for d in ("ours", "peft", "plain"))
    assert ours.keys() == theirs.keys() == plain.keys() and len(ours) == (2 if build is _two_adapters else 1)
    for folder, tensors in theirs.items():
        assert ours[folder].keys() == tensors.keys() == plain[folder].keys(), folder
        for key, value in tensors.items():
            assert torch.equal(ours[folder][key], value), (folder, key)
