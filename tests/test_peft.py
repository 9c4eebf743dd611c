"""PEFT's LoRA (the `peft` package) on a small Llama built under zero.Init and trained by our engine with ZeRO-3,
parameters and optimizer state on nvme: PEFT counts the partitioned model's parameters from `ds_numel`, the adapter
trains, and `save_pretrained` / `PeftModel.from_pretrained` (PEFT's own calls) give back the trained adapter: a
fresh base model with it loaded computes the engine's loss.
"""
from __future__ import annotations

import peft
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
