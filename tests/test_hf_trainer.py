"""The Hugging Face Trainer trains with our engine (zero.integrations.ZeroTrainer): same losses as the plain
Trainer, exact resume from its checkpoint-N folders, consolidated weights from_pretrained loads, gradient
checkpointing and a LoRA-style model with frozen base weights under stage 3 with offload, and a config whose
"auto" the arguments cannot fill named in the error.

Everything is local and small: byte-level windows of a standard-library source file, 2-layer models of
hidden size 64 built from a config, fp32 on CPU, a fixed seed, ZeRO-3 with parameters and optimizer state on
nvme under tmp_path, written as the Hugging Face docs' ds_config.json is (every value "auto" it fills).
"""
from __future__ import annotations

import copy
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from torch.optim.lr_scheduler import LambdaLR  # noqa: E402

from zero.config import ConfigError, UnresolvedAutoError  # noqa: E402
from zero.integrations import EngineOptimizer, EngineScheduler, ZeroTrainer, ZeroTrainingArguments  # noqa: E402

from test_config import HF_ZERO3  # noqa: E402  (the Hugging Face docs' ZeRO-3 ds_config)

SEQ = 16
STEPS = 20


def dataset(n: int = 96) -> list[dict[str, torch.Tensor]]:
    """n windows of SEQ bytes of textwrap.py, as token ids (labels = inputs: the model shifts them)."""
    data = Path(textwrap.__file__).read_bytes()
    ids = torch.tensor(list(data[: n * SEQ]), dtype=torch.long).view(n, SEQ)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def gpt2() -> GPT2LMHeadModel:
    """Tied input and output embeddings, and dropout (the resume must restore the RNG)."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                      bos_token_id=0, eos_token_id=0))


def hf_docs_zero3(nvme: Path, *, optimizer: bool = True, scheduler: bool = True,
                  accumulation: str | None = None) -> dict:
    """The Hugging Face docs' ZeRO-3 ds_config.json, offloading to nvme; without the optimizer or scheduler
    section the Trainer's own are used. `accumulation` "micro-batch": a step's micro-batches one after another,
    so dropout draws its masks in the plain Trainer's order (unit-major draws them a unit at a time)."""
    nvme.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(HF_ZERO3)
    for section in ("offload_optimizer", "offload_param"):
        config["zero_optimization"][section] = {"device": "nvme", "nvme_path": str(nvme), "pin_memory": True}
    if accumulation is not None:
        config["zero_tiering"] = {"accumulation": accumulation}
    if not optimizer:
        del config["optimizer"]
    if not scheduler:
        del config["scheduler"]
    return config


def training_args(cls: type, out: Path, **overrides) -> TrainingArguments:
    base = dict(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                learning_rate=3e-3, weight_decay=0.01, adam_beta2=0.95, max_grad_norm=0.5, warmup_steps=4,
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
                seed=1234, disable_tqdm=True)
    base.update(overrides)
    return cls(**base)


def losses(trainer: Trainer) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


def logged(trainer: Trainer, key: str) -> list[float]:
    return [e[key] for e in trainer.state.log_history if "loss" in e]


class DeepSpeedScheduleTrainer(Trainer):
    """The plain Trainer stepping DeepSpeed's WarmupDecayLR (log warmup from warmup_min_lr = 0), the schedule
    the docs' config asks the engine for: optimizer step k runs at the schedule's iteration k - 1."""

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            warmup = max(2, self.args.get_warmup_steps(num_training_steps))
            total = num_training_steps

            def factor(k: int) -> float:
                it = k - 1
                if it < 0:
                    return 0.0
                if it < warmup:
                    return math.log(it + 1) / math.log(warmup)
                return max(0.0, (total - it) / max(1.0, total - warmup))

            self.lr_scheduler = LambdaLR(optimizer or self.optimizer, factor)
        return self.lr_scheduler


class StopAt(TrainerCallback):
    """Stops training after optimizer step `step` (the run that is interrupted)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


class SignalAt(TrainerCallback):
    """Sends this process SIGTERM at the end of optimizer step `step` (a scheduler preempting the job)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tolerance) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if tolerance:
            torch.testing.assert_close(a[name], b[name], **tolerance, msg=lambda m, name=name: f"{name}: {m}")
        else:
            assert torch.equal(a[name], b[name]), name


# ------------------------------------------------------------------------------------------------------------


def test_llama_zero3_nvme_from_ds_config_json_trains_like_the_plain_trainer(tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(hf_docs_zero3(tmp_path / "nvme")))
    data = dataset()
    reference = DeepSpeedScheduleTrainer(model=llama(), args=training_args(TrainingArguments, tmp_path / "plain"),
                                         train_dataset=data)
    reference.train()
    trainer = ZeroTrainer(model=llama(), train_dataset=data,
                          args=training_args(ZeroTrainingArguments, tmp_path / "zero", deepspeed=str(config)))
    assert trainer.args.deepspeed is None and trainer.args.zero_config == str(config)
    try:
        trainer.train()
        engine = trainer.engine
        assert engine.stage == 3 and isinstance(trainer.optimizer, EngineOptimizer)
        zo = engine.config.zero_optimization
        assert (zo.offload_param.device, zo.offload_optimizer.device) == ("nvme", "nvme")
        assert (engine.config.gradient_accumulation_steps, engine.config.gradient_clipping) == (2, 0.5)
        assert engine.global_steps == STEPS and engine.micro_steps == 2 * STEPS
        assert engine.schedule == "unit-major"  # the 2 micro-batches of a step through each layer at once
        ours, theirs = losses(trainer), losses(reference)
        assert list(ours) == list(range(1, STEPS + 1))
        assert list(ours.values()) == pytest.approx(list(theirs.values()), rel=1e-5)
        assert logged(trainer, "grad_norm") == pytest.approx(logged(reference, "grad_norm"), rel=1e-4)
        assert logged(trainer, "learning_rate") == pytest.approx(logged(reference, "learning_rate"), rel=1e-12)

        held_out = dataset(8)  # evaluation goes through the engine too (parameters gathered unit by unit)
        assert trainer.evaluate(held_out)["eval_loss"] == pytest.approx(reference.evaluate(held_out)["eval_loss"],
                                                                          rel=1e-5)

        trainer.save_model()  # consolidated: model.safetensors + config.json
        out = tmp_path / "zero"
        assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
        loaded = LlamaForCausalLM.from_pretrained(out)
        assert_same_tensors(loaded.state_dict(), engine.module_state_dict())
        assert_same_tensors(loaded.state_dict(), reference.model.state_dict(), rtol=1e-4, atol=1e-5)
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory):
    """The plain Trainer, and ours uninterrupted, interrupted after checkpoint-10 and resumed from it: GPT-2,
    a config without optimizer and scheduler sections (the Trainer's AdamW and linear schedule, built on the
    engine's optimizer), given as ZeroTrainer(zero_config=...) beside plain TrainingArguments."""
    tmp = tmp_path_factory.mktemp("gpt2")
    data = dataset()
    config = hf_docs_zero3(tmp / "nvme", optimizer=False, scheduler=False, accumulation="micro-batch")  # dropout
    reference = Trainer(model=gpt2(), args=training_args(TrainingArguments, tmp / "plain"), train_dataset=data)
    reference.train()
    runs = {"reference": reference}
    try:
        runs["whole"] = ZeroTrainer(model=gpt2(), args=training_args(TrainingArguments, tmp / "whole"),
                                    train_dataset=data, zero_config=config)
        runs["whole"].train()
        runs["interrupted"] = ZeroTrainer(
            model=gpt2(), args=training_args(TrainingArguments, tmp / "interrupted", save_strategy="steps",
                                             save_steps=10),
            train_dataset=data, zero_config=config, callbacks=[StopAt(10)])
        runs["interrupted"].train()
        runs["interrupted"].close()
        runs["resumed"] = ZeroTrainer(model=gpt2(), args=training_args(TrainingArguments, tmp / "resumed"),
                                      train_dataset=data, zero_config=config)
        runs["resumed"].train(resume_from_checkpoint=str(tmp / "interrupted" / "checkpoint-10"))
        signalled = training_args(ZeroTrainingArguments, tmp / "signalled", zero_config=config, save_on_signal=True)
        runs["signalled"] = ZeroTrainer(model=gpt2(), args=signalled, train_dataset=data, callbacks=[SignalAt(7)])
        runs["signalled"].train()
        runs["signalled"].close()
        runs["continued"] = ZeroTrainer(model=gpt2(), args=signalled, train_dataset=data)
        runs["continued"].train(resume_from_checkpoint=True)
        yield runs
    finally:
        for name in ("whole", "interrupted", "resumed", "signalled", "continued"):
            if name in runs:
                runs[name].close()


def test_pretrained_weights_go_straight_into_the_tiers_and_train_like_the_model_in_memory(tmp_path):
    """A save_pretrained checkpoint, loaded by a model built on meta unit by unit (zero_weights=), trains as the
    same checkpoint loaded in memory does under the plain Trainer."""
    gpt2().save_pretrained(tmp_path / "pretrained")
    data = dataset()
    reference = DeepSpeedScheduleTrainer(model=GPT2LMHeadModel.from_pretrained(tmp_path / "pretrained"),
                                         args=training_args(TrainingArguments, tmp_path / "plain", max_steps=4),
                                         train_dataset=data)
    reference.train()
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config.from_pretrained(tmp_path / "pretrained"))
    trainer = ZeroTrainer(model=model, train_dataset=data, zero_weights=tmp_path / "pretrained",
                          args=training_args(ZeroTrainingArguments, tmp_path / "zero", max_steps=4,
                                             deepspeed=hf_docs_zero3(tmp_path / "nvme",
                                                                     accumulation="micro-batch")))  # dropout
    try:
        trainer.train()
        assert list(losses(trainer).values()) == pytest.approx(list(losses(reference).values()), rel=1e-5)
    finally:
        trainer.close()


def test_gpt2_with_the_trainers_optimizer_and_schedule_trains_like_the_plain_trainer(gpt2_runs):
    whole, reference = gpt2_runs["whole"], gpt2_runs["reference"]
    assert isinstance(whole.lr_scheduler, EngineScheduler)
    assert type(whole.lr_scheduler.scheduler).__name__ == "LambdaLR"  # the Trainer's, stepped by the engine
    ours, theirs = losses(whole), losses(reference)
    assert len(ours) == STEPS
    assert list(ours.values()) == pytest.approx(list(theirs.values()), rel=1e-5)
    assert logged(whole, "learning_rate") == pytest.approx(logged(reference, "learning_rate"), rel=1e-12)


def test_resume_from_checkpoint_continues_bitwise(gpt2_runs, tmp_path):
    whole, interrupted, resumed = gpt2_runs["whole"], gpt2_runs["interrupted"], gpt2_runs["resumed"]
    checkpoint = Path(interrupted.args.output_dir) / "checkpoint-10"
    assert (checkpoint / "latest").read_text() == "global_step10"
    assert (checkpoint / "trainer_state.json").is_file() and (checkpoint / "rng_state.pth").is_file()
    assert (checkpoint / "model.safetensors").is_file() and not (checkpoint / "optimizer.pt").exists()
    assert max(losses(interrupted)) == 10 and resumed.state.global_step == STEPS
    later = {step: loss for step, loss in losses(whole).items() if step > 10}
    assert {step: loss for step, loss in losses(resumed).items() if step > 10} == later  # exactly
    final = resumed.engine.module_state_dict()
    assert_same_tensors(final, whole.engine.module_state_dict())  # bitwise
    resumed.save_model(str(tmp_path / "final"))
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "final")
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # tied again
    assert_same_tensors(loaded.state_dict(), final)


def test_a_signal_saves_a_checkpoint_the_trainer_resumes_bitwise(gpt2_runs):
    """SIGTERM during step 7 (ZeroTrainingArguments(save_on_signal=True)): checkpoint-7 is saved, training stops,
    and train(resume_from_checkpoint=True) continues as the uninterrupted run, bit for bit."""
    whole, signalled, continued = gpt2_runs["whole"], gpt2_runs["signalled"], gpt2_runs["continued"]
    saved = sorted(p.name for p in Path(signalled.args.output_dir).glob("checkpoint-*"))
    assert saved == ["checkpoint-7"] and signalled.state.global_step == 7 and max(losses(signalled)) == 7
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "the handler outlived training"
    assert continued.state.global_step == STEPS
    assert {s: loss for s, loss in losses(continued).items() if s > 7} == {
        s: loss for s, loss in losses(whole).items() if s > 7}
    assert_same_tensors(continued.engine.module_state_dict(), whole.engine.module_state_dict())


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (LoRA's shape, B starting at zero)."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: float = 8.0):
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


def lora_llama() -> LlamaForCausalLM:
    model = llama()
    model.requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj)
    # gradient_checkpointing_enable() under its transformers 5 name (the old one warns it is deprecated)
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    return model


def test_lora_with_gradient_checkpointing_under_stage3_offload(tmp_path):
    steps = 8
    data = dataset()
    config = hf_docs_zero3(tmp_path / "nvme")
    reference = DeepSpeedScheduleTrainer(model=lora_llama(), train_dataset=data,
                                         args=training_args(TrainingArguments, tmp_path / "plain", max_steps=steps))
    reference.train()
    model = lora_llama()
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    calls = []  # a checkpointed layer runs its forward again in backward (the MLP inside it: the layer's own
    # hooks stay outside the checkpoint)
    model.model.layers[0].mlp.register_forward_pre_hook(lambda module, args: calls.append(module.training))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trainer = ZeroTrainer(model=model, train_dataset=data, zero_config=config,
                          args=training_args(TrainingArguments, tmp_path / "zero", max_steps=steps))
    try:
        trainer.train()
        engine = trainer.engine
        assert list(losses(trainer).values()) == pytest.approx(list(losses(reference).values()), rel=1e-5)
        # Forward and recomputation, 2 micro-batches a step, unit-major (the model's own checkpointing off: each
        # unit recomputes itself), and the probe's one forward in eval mode at the first step.
        assert calls.count(True) == 2 * 2 * steps and calls.count(False) == 1
        # Only the LoRA parameters are in trained units, so only they have optimizer state and gradients; the
        # frozen weights are in units of their own, without either.
        trained = [unit for unit in engine.units if not unit.frozen]
        slots = [slot for unit in trained for slot in unit.flat.slots]
        assert slots and all(slot.param.requires_grad and ".lora_" in slot.name for slot in slots)
        assert sum(slot.numel for slot in slots) == trainable
        assert {slot.name for unit in engine.units if unit.frozen for slot in unit.flat.slots} == set(frozen)
        padded = sum(unit.flat.padded_numel for unit in trained)  # one rank: its shard is the whole unit
        assert sum(sg.numel for sg in engine.driver.sub_groups) == padded
        moments = sum(seg.nbytes for name, seg in engine.swap.segments.items()
                      if name.endswith(("/exp_avg", "/exp_avg_sq")))
        assert moments == 2 * 4 * padded < 4 * sum(t.numel() for t in frozen.values())
        state = engine.module_state_dict()
        for name, p in model.named_parameters():
            if not p.requires_grad:
                assert p.grad is None and torch.equal(state[name], frozen[name]), name
    finally:
        trainer.close()


@pytest.mark.parametrize("changes, error, key", [
    ({"zero_optimization__stage3_max_live_parameters": "auto"}, UnresolvedAutoError,
     "zero_optimization.stage3_max_live_parameters"),
    ({"gradient_accumulation_steps": 4}, ConfigError, "gradient_accumulation_steps"),
], ids=["auto no argument fills", "written value contradicts the arguments"])
def test_a_config_the_arguments_cannot_fill_names_the_key(tmp_path, changes, error, key):
    config = hf_docs_zero3(tmp_path / "nvme")
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = config
        for part in parents:
            node = node[part]
        node[leaf] = value
    data = dataset(8)
    # max_steps given: every fact is known when the trainer is made, so the error comes then
    with pytest.raises(error, match=re.escape(key)) as info:
        ZeroTrainer(model=llama(), train_dataset=data, zero_config=config,
                    args=training_args(TrainingArguments, tmp_path / "a"))
    assert info.value.key == key
    # epochs instead: the number of steps is known in train(), which raises before any step
    trainer = ZeroTrainer(model=llama(), train_dataset=data, zero_config=config,
                          args=training_args(TrainingArguments, tmp_path / "b", max_steps=-1, num_train_epochs=1))
    with pytest.raises(error, match=re.escape(key)):
        trainer.train()
    assert trainer.engine is None and trainer.state.global_step == 0


def test_a_config_writing_false_for_gathering_16bit_weights_on_save_is_taken_as_written(tmp_path):
    """Many DeepSpeed configs write it false; the Trainer's save_model writes consolidated weights whatever it says,
    and transformers checks it against nothing."""
    config = hf_docs_zero3(tmp_path / "nvme")
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    trainer = ZeroTrainer(model=llama(), train_dataset=dataset(8), zero_config=config,
                          args=training_args(TrainingArguments, tmp_path / "a"))
    assert trainer._resolved_config(4)["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is False


def test_save_only_model_with_load_best_model_at_end_is_refused_before_training(tmp_path):
    args = training_args(TrainingArguments, tmp_path, save_only_model=True, load_best_model_at_end=True,
                         eval_strategy="steps", save_strategy="steps", eval_steps=2, save_steps=2)
    with pytest.raises(ValueError, match="save_only_model=True with load_best_model_at_end=True"):
        ZeroTrainer(model=llama(), args=args, train_dataset=dataset(8), eval_dataset=dataset(4),
                    zero_config=hf_docs_zero3(tmp_path / "nvme"))


def test_a_trainer_without_a_config_says_how_to_give_one(tmp_path):
    with pytest.raises(ValueError, match="ZeroTrainingArguments"):
        ZeroTrainer(model=llama(), args=training_args(TrainingArguments, tmp_path), train_dataset=dataset(8))


def test_an_epoch_that_ends_inside_an_accumulation_window_is_an_error(tmp_path):
    """10 samples, 2 a batch: 5 micro-batches, and the Trainer steps after the 5th; the engine, accumulating 2,
    would not, so training stops there saying why (DeepSpeed carries the gradient into the next epoch)."""
    trainer = ZeroTrainer(model=llama(), train_dataset=dataset(10), zero_config=hf_docs_zero3(tmp_path / "nvme"),
                          args=training_args(TrainingArguments, tmp_path, max_steps=-1, num_train_epochs=1))
    try:
        with pytest.raises(RuntimeError, match="multiple of gradient_accumulation_steps"):
            trainer.train()
        assert trainer.state.global_step == 2
    finally:
        trainer.close()


def test_a_compact_state_format_trains_under_the_trainer(gpt2_runs, tmp_path):
    """zero_tiering.moments int8 in the Trainer's ds_config: the engine stores int8 moments, and the losses stay
    within a few percent of the plain Trainer's (the format's price, measured by bench/quality.py)."""
    config = hf_docs_zero3(tmp_path / "nvme", optimizer=False, scheduler=False)
    config["zero_tiering"] = {"moments": "int8"}
    trainer = ZeroTrainer(model=gpt2(), args=training_args(TrainingArguments, tmp_path / "int8"),
                          train_dataset=dataset(), zero_config=config)
    try:
        trainer.train()
        assert trainer.engine.driver.state_format.moments == "int8"
        assert any("int8" in sg.codecs.exp_avg.name for sg in trainer.engine.driver.sub_groups)
        ours, theirs = losses(trainer), losses(gpt2_runs["reference"])
        assert list(ours.values()) == pytest.approx(list(theirs.values()), rel=0.03)
    finally:
        trainer.close()


class LlamaOwnMean(LlamaForCausalLM):
    """A model the Trainer treats as taking no loss kwargs: it divides each micro-batch's mean loss itself."""
    accepts_loss_kwargs = False


def bert_masked_lm() -> nn.Module:
    """Accepts **kwargs (so the Trainer passes num_items_in_batch and adds the micro-batches' losses undivided) but
    takes its own mean: the plain Trainer's loss is the accumulation steps times a mean weighted per micro-batch."""
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


@pytest.mark.parametrize("build, schedule", [(llama, "unit-major"), (lambda: LlamaOwnMean(llama().config),
                                             "micro-batch"), (bert_masked_lm, "micro-batch")],
                         ids=["reads-the-item-count", "no-loss-kwargs", "own-mean"])
def test_a_step_of_micro_batches_with_unequal_item_counts_trains_as_the_plain_trainer(tmp_path, build, schedule):
    """Labels masked after a varying number of tokens: the micro-batches' item counts differ. Unit-major's one loss
    over the stacked step is the plain Trainer's only where the model's loss reads num_items_in_batch; a model
    taking its own mean runs micro-batch by micro-batch (seen in the probe's forward), as the warning says."""
    from zero.accumulation.unit_major import UnitMajorWarning

    data = dataset(32)
    for i, row in enumerate(data):
        row["labels"][2 + (i * 5) % (SEQ - 2):] = -100
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto",
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                    "offload_optimizer": {"device": "cpu"}}}
    settings = dict(max_steps=6, weight_decay=0.0, warmup_steps=0, lr_scheduler_type="constant", max_grad_norm=1.0)
    reference = Trainer(model=build(), args=training_args(TrainingArguments, tmp_path / "plain", **settings),
                        train_dataset=data)
    reference.train()
    trainer = ZeroTrainer(model=build(), args=training_args(TrainingArguments, tmp_path / "zero", **settings),
                          train_dataset=data, zero_config=config)
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            trainer.train()
        assert trainer.engine.schedule == schedule
        told = [str(w.message) for w in said if issubclass(w.category, UnitMajorWarning)]
        if schedule == "micro-batch" and build is bert_masked_lm:
            assert any("does not read num_items_in_batch" in m for m in told), told
        assert list(losses(trainer).values()) == pytest.approx(list(losses(reference).values()), rel=1e-5)
        assert logged(trainer, "grad_norm") == pytest.approx(logged(reference, "grad_norm"), rel=1e-4)
        assert_same_tensors(trainer.engine.module_state_dict(), reference.model.state_dict(), rtol=1e-4, atol=1e-5)
    finally:
        trainer.close()


@pytest.mark.parametrize("scheduler", ["trainer", "config"])
def test_a_second_train_call_schedules_the_learning_rate_anew(tmp_path, scheduler):
    """The plain Trainer makes the scheduler it made anew at every train() (the optimizer goes on as it was): a
    second train() ran at learning rate 0 on the engine's spent schedule. Both the Trainer's schedule and the
    config's (WarmupDecayLR over "auto" steps) start again; the Trainer's trains as the plain Trainer's does."""
    settings = dict(max_steps=4, warmup_steps=0, lr_scheduler_type="linear", max_grad_norm=0.0)
    config = hf_docs_zero3(tmp_path / "nvme", optimizer=False, scheduler=scheduler == "config")
    trainer = ZeroTrainer(model=llama(), args=training_args(TrainingArguments, tmp_path / "zero", **settings),
                          train_dataset=dataset(32), zero_config=config)
    reference = Trainer(model=llama(), args=training_args(TrainingArguments, tmp_path / "plain", **settings),
                        train_dataset=dataset(32))
    try:
        runs = []
        for _ in range(2):
            trainer.train()
            runs.append((logged(trainer, "learning_rate"), losses(trainer)))
        assert runs[1][0] == runs[0][0] and max(runs[1][0]) > 0
        if scheduler == "trainer":
            for _ in range(2):
                reference.train()
            assert runs[1][0] == logged(reference, "learning_rate")
            assert list(runs[1][1].values()) == pytest.approx(list(losses(reference).values()), rel=1e-5)
    finally:
        trainer.close()


def test_evaluate_before_train_runs_in_the_engine_and_training_then_follows_the_plain_trainer(tmp_path):
    """A model on meta with its weights in a file (they are nowhere else): evaluate() before train() went around
    the engine and crashed copying meta tensors. It builds the engine, as the Trainer builds DeepSpeed's there;
    train() then makes the LR scheduler for its steps and trains as the plain Trainer does."""
    llama().save_pretrained(tmp_path / "pretrained")
    with torch.device("meta"):
        empty = LlamaForCausalLM(llama().config)
    settings = dict(max_steps=4)
    trainer = ZeroTrainer(model=empty, args=training_args(TrainingArguments, tmp_path / "zero", **settings),
                          train_dataset=dataset(32), zero_weights=tmp_path / "pretrained",
                          zero_config=hf_docs_zero3(tmp_path / "nvme", optimizer=False, scheduler=False))
    reference = Trainer(model=llama(), args=training_args(TrainingArguments, tmp_path / "plain", **settings),
                        train_dataset=dataset(32))
    held_out = dataset(8)
    try:
        assert trainer.evaluate(held_out)["eval_loss"] == pytest.approx(reference.evaluate(held_out)["eval_loss"],
                                                                          rel=1e-5)
        trainer.train()
        reference.train()
        assert logged(trainer, "learning_rate") == logged(reference, "learning_rate")
        assert list(losses(trainer).values()) == pytest.approx(list(losses(reference).values()), rel=1e-5)
    finally:
        trainer.close()


TWO_RANKS = textwrap.dedent("""
    import json, sys, torch, warnings
    import torch.distributed as dist
    warnings.filterwarnings("ignore")
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    from zero.integrations import ZeroTrainer

    def llama():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))

    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, 256, (32, 16), generator=g)]
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                                 "offload_optimizer": {"device": "cpu"}}}
    losses = {}
    for name in ("zero", "plain"):
        args = TrainingArguments(output_dir=sys.argv[1] + "/" + name, max_steps=3, per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, learning_rate=3e-3, logging_steps=1, save_strategy="no",
                                 report_to=[], use_cpu=True, seed=1234, disable_tqdm=True, ddp_backend="gloo",
                                 lr_scheduler_type="constant")
        trainer = (ZeroTrainer(model=llama(), args=args, train_dataset=data, zero_config=config) if name == "zero"
                   else Trainer(model=llama(), args=args, train_dataset=data))
        trainer.train()
        losses[name] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        if name == "zero":
            trainer.close()
    if dist.get_rank() == 0:
        print(json.dumps(losses))
""")


def test_two_ranks_with_accumulation_train_as_the_plain_trainer_under_ddp(tmp_path):
    """The Trainer wraps every micro-batch but a step's last in accelerate's no_sync, which the engine (its own
    reductions) refuses with several ranks: the Trainer is told each batch syncs, and trains as DDP does."""
    from stage3_models import free_port

    from conftest import child_env

    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(script), str(tmp_path)], cwd=tmp_path,
                          env=child_env() | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(losses["zero"]) == 3 and losses["zero"] == pytest.approx(losses["plain"], rel=1e-5)
