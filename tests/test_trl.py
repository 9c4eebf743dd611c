"""TRL's trainers on our engine (zero.integrations.zero_trainer): SFTTrainer through it trains a tiny Llama with
ZeRO-3, parameters and optimizer state on nvme, fp32, to the losses plain SFTTrainer gives on the same data; TRL's
own overrides run (its loss and metrics, its training_step context), the model generates as the plain one does
(greedy, the same tokens), and save_model writes what from_pretrained loads. DPOTrainer through it, its reference
model partitioned into the tiers (no weights outside its forward, no optimizer), gives plain DPOTrainer's losses.
The README's block runs as written. Local and small: a word-level tokenizer built here, sentences of its words, a 2-layer Llama."""
from __future__ import annotations

import copy
import random
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from zero.integrations import ZeroTrainer, zero_trainer  # noqa: E402

from conftest import child_env, readme_block  # noqa: E402
from test_config import HF_ZERO3  # noqa: E402  (the Hugging Face docs' ZeRO-3 ds_config)

WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be or has had "
         "one first new two their after its who but also they she been other more time over most can into").split()
STEPS = 6


def tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(["<unk>", "<pad>", "</s>", *WORDS])}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")


def dataset(n: int = 48):
    """Sentences of 6 to 20 words (padding in every batch)."""
    rng = random.Random(0)
    return datasets.Dataset.from_dict({"text": [" ".join(rng.choices(WORDS, k=rng.randint(6, 20))) for _ in range(n)]})


def llama(vocab: int) -> LlamaForCausalLM:
    """MLP weights of 64 x 128 elements: over 4096, so a compact format would quantize them."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        pad_token_id=1, eos_token_id=2, bos_token_id=None))


def sft_config(out, **overrides):
    base = dict(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                learning_rate=3e-3, weight_decay=0.01, max_grad_norm=0.5, warmup_steps=2, logging_steps=1,
                save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0, seed=1234,
                disable_tqdm=True, max_length=32, bf16=False)
    base.update(overrides)
    return trl.SFTConfig(**base)


def zero3_nvme(nvme) -> dict:
    """The docs' ZeRO-3 config (every value "auto"), parameters and optimizer state on nvme, without optimizer and
    scheduler sections: the Trainer's AdamW and schedule, as plain SFTTrainer has them."""
    nvme.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(HF_ZERO3)
    for section in ("offload_optimizer", "offload_param"):
        config["zero_optimization"][section] = {"device": "nvme", "nvme_path": str(nvme)}
    del config["optimizer"], config["scheduler"]
    return config


def losses(trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def test_sft_trainer_through_zero_trainer_matches_plain_sft(tmp_path):
    tok = tokenizer()
    data = dataset()
    plain = trl.SFTTrainer(model=llama(len(tok)), args=sft_config(tmp_path / "plain"), train_dataset=data,
                           processing_class=tok)
    plain.train()

    ZeroSFTTrainer = zero_trainer(trl.SFTTrainer)
    mro = ZeroSFTTrainer.__mro__
    assert mro.index(trl.SFTTrainer) < mro.index(ZeroTrainer) < mro.index(trl.SFTTrainer.__mro__[-2])
    ours = ZeroSFTTrainer(model=llama(len(tok)), args=sft_config(tmp_path / "ours"), train_dataset=data,
                          processing_class=tok, zero_config=zero3_nvme(tmp_path / "nvme"))
    try:
        ours.train()
        assert ours.engine is not None and ours.engine.stage == 3
        assert len(losses(ours)) == STEPS
        assert losses(ours) == pytest.approx(losses(plain), rel=1e-6, abs=1e-6)
        # TRL's compute_loss ran through the engine: its token metrics are logged beside the loss
        assert all("mean_token_accuracy" in e and "entropy" in e for e in ours.state.log_history if "loss" in e)
        # generation, as TRL's generating trainers call it on their model, gathers our parameters unit by unit
        prompt = tok(["the first new time"], return_tensors="pt").input_ids
        with torch.no_grad():
            greedy = [trainer.model.generate(prompt, min_new_tokens=6, max_new_tokens=6, do_sample=False)
                      for trainer in (ours, plain)]
        assert greedy[0].shape == (1, prompt.shape[1] + 6) and torch.equal(greedy[0], greedy[1])

        ours.save_model(str(tmp_path / "saved"))
        loaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "saved"))
        theirs = dict(plain.model.named_parameters())
        for name, param in loaded.named_parameters():
            torch.testing.assert_close(param, theirs[name], rtol=0, atol=1e-6, msg=name)
    finally:
        ours.close()


def preferences(n: int = 24):
    rng = random.Random(1)

    def sentence(k: int) -> str:
        return " ".join(rng.choices(WORDS, k=k))

    return datasets.Dataset.from_dict({"prompt": [sentence(5) for _ in range(n)],
                                       "chosen": [sentence(6) for _ in range(n)],
                                       "rejected": [sentence(7) for _ in range(n)]})


def dpo_config(out, **overrides):
    base = dict(output_dir=str(out), max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                dataloader_num_workers=0, seed=1234, disable_tqdm=True, max_length=32, bf16=False)
    base.update(overrides)
    return trl.DPOConfig(**base)


def test_dpo_trainer_runs_its_reference_model_through_the_tiers(tmp_path):
    tok = tokenizer()
    data = preferences()
    plain = trl.DPOTrainer(model=llama(len(tok)), ref_model=llama(len(tok)), args=dpo_config(tmp_path / "plain"),
                           train_dataset=data, processing_class=tok)
    plain.train()
    ours = zero_trainer(trl.DPOTrainer)(model=llama(len(tok)), ref_model=llama(len(tok)),
                                        args=dpo_config(tmp_path / "ours"), train_dataset=data, processing_class=tok,
                                        zero_config=zero3_nvme(tmp_path / "nvme"))
    try:
        assert sum(p.numel() for p in ours.ref_model.parameters()) == 0  # partitioned: gathered for its forward only
        ours.train()
        assert sum(p.numel() for p in ours.ref_model.parameters()) == 0
        assert not any(p.requires_grad for p in ours.ref_model.parameters())
        assert losses(ours) == pytest.approx(losses(plain), rel=1e-5, abs=1e-5)
        assert any(e.get("rewards/margins") for e in ours.state.log_history)  # the reference's log-probs differ
    finally:
        ours.close()


def test_a_synced_reference_model_is_refused(tmp_path):
    tok = tokenizer()
    with pytest.raises(ValueError, match="sync_ref_model=True .* not supported"):
        zero_trainer(trl.DPOTrainer)(model=llama(len(tok)), ref_model=llama(len(tok)),
                                     args=dpo_config(tmp_path, sync_ref_model=True), train_dataset=preferences(),
                                     processing_class=tok, zero_config=zero3_nvme(tmp_path / "nvme"))


def test_zero_trainer_takes_trainer_subclasses_only():
    with pytest.raises(TypeError, match="a subclass of transformers.Trainer"):
        zero_trainer(dict)
    assert zero_trainer(ZeroTrainer) is ZeroTrainer


def test_the_readmes_trl_block_runs_as_written(tmp_path):
    """The README's "From TRL" block, in a fresh process: SFTTrainer through zero_trainer trains its 8 steps and
    save_model writes what from_pretrained loads."""
    script = tmp_path / "from_trl.py"
    script.write_text(readme_block("### From TRL"))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=child_env() | {"OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "out" / "checkpoint-8").is_dir()
    loaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert loaded.config.num_hidden_layers == 2
    assert all(torch.isfinite(param).all() for param in loaded.parameters())
