"""The engine's face, as deepspeed.initialize's users call it: train()/eval(), module, device, global_steps,
get_lr(), step() on every micro-batch with the optimizer only at the accumulation boundary, and what
initialize returns."""
from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.distributed as dist

import zero
from zero.config import ConfigError

from models import one_thread  # noqa: F401  (autouse fixture)
from models import LR, batches, engine_train, make_config, named_params, no_decay_groups, tied_blocks, tiny_gpt2


def test_module_device_and_single_rank_needs_no_process_group():
    model = tied_blocks(0)
    engine, optimizer, loader, scheduler = zero.initialize(model=model, config=make_config(1, "cpu"))
    try:
        assert engine.module is model
        cuda = torch.cuda.is_available()
        expected = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        assert engine.device == expected
        assert all(p.device == expected for p in model.parameters())
        assert not dist.is_initialized() and engine.dp.world_size == 1
        assert loader is None and scheduler is None
        assert optimizer is engine.optimizer and len(optimizer.param_groups) == 1
        assert engine.global_steps == 0 and engine.skipped_steps == 0
    finally:
        engine.close()


def test_train_and_eval_switch_the_module():
    """eval() turns dropout off in every submodule (two forwards agree, and agree with the bare module),
    train() turns it back on; both return the engine, as nn.Module's do."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5, bos_token_id=0,
                                       eos_token_id=0))
    engine, *_ = zero.initialize(model=model, config=make_config(2, "cpu"))
    ids = batches(1)[0].to(engine.device)
    try:
        assert engine.eval() is engine
        assert not any(m.training for m in model.modules())
        with torch.no_grad():
            first, second = (engine(input_ids=ids).logits for _ in range(2))
            bare = model(input_ids=ids).logits
        assert torch.equal(first, second) and torch.equal(first, bare)
        assert engine.train() is engine
        assert all(m.training for m in model.modules())
        with torch.no_grad():
            assert not torch.equal(engine(input_ids=ids).logits, engine(input_ids=ids).logits), "dropout is off"
    finally:
        engine.close()


@pytest.mark.parametrize("stage,offload", [(0, "none"), (2, "nvme")])
def test_step_every_micro_batch_optimizer_at_boundary(stage, offload, tmp_path):
    """step() is called after every micro-batch; parameters change only at every third call (accumulation
    3), where global_steps advances and is_gradient_accumulation_boundary() was true before the call."""
    accum, steps = 3, 3
    model = tied_blocks(0)
    engine, *_ = zero.initialize(model=model, config=make_config(stage, offload, accum=accum, nvme_path=tmp_path))
    try:
        for index, ids in enumerate(batches(accum * steps)):
            boundary = (index + 1) % accum == 0
            assert engine.is_gradient_accumulation_boundary() == boundary
            before = named_params(model)
            engine_train(engine, [ids])
            after = named_params(model)
            changed = [k for k in before if not torch.equal(before[k], after[k])]
            if boundary:
                assert set(changed) == set(before) - {"frozen"}, "the optimizer step left parameters unchanged"
            else:
                assert not changed, f"parameters changed inside an accumulation window: {changed}"
            assert engine.global_steps == (index + 1) // accum
            assert all(p.grad is None for p in model.parameters()), "gradients left on the parameters"
    finally:
        engine.close()


def test_evaluation_inside_an_accumulation_window_changes_nothing():
    """An eval forward under no_grad between micro-batches of one window leaves the accumulated gradient
    alone: the run ends exactly where one without it does."""
    accum = 2
    data = batches(4 * accum)
    results = []
    for evaluate in (False, True):
        model = tied_blocks(0)
        engine, *_ = zero.initialize(model=model, config=make_config(2, "cpu", accum=accum, clip=1.0))
        for index, ids in enumerate(data):
            engine_train(engine, [ids])
            if evaluate and index % accum == 0:
                engine.eval()
                with torch.no_grad():
                    engine(input_ids=ids, labels=ids)
                engine.train()
        engine.close()
        results.append(named_params(model))
    for key in results[0]:
        assert torch.equal(results[0][key], results[1][key]), key


def test_get_lr_per_param_group():
    model = tiny_gpt2(0)
    groups = no_decay_groups(model, 0.1)
    groups[1]["lr"] = LR / 10
    engine, optimizer, _, _ = zero.initialize(model=model, model_parameters=groups, config=make_config(1, "cpu"))
    try:
        assert engine.get_lr() == [LR, LR / 10]
        optimizer.param_groups[0]["lr"] = 5e-4  # what a scheduler does: the engine reads the groups
        assert engine.get_lr() == [5e-4, LR / 10]
        assert [len(g["params"]) for g in optimizer.param_groups] == [len(g["params"]) for g in groups]
    finally:
        engine.close()


def test_frozen_parameters_are_left_alone():
    model = tied_blocks(0)
    frozen = model.frozen.detach().clone()
    engine, optimizer, *_ = zero.initialize(model=model, config=make_config(2, "cpu", bf16={"enabled": True}))
    try:
        engine_train(engine, batches(3))
        assert not model.frozen.requires_grad and model.frozen.grad is None
        assert torch.equal(model.frozen.float(), frozen)
        assert all(p is not model.frozen for g in optimizer.param_groups for p in g["params"])
    finally:
        engine.close()


@pytest.mark.parametrize("drop_last, expected", [(None, [3, 3, 3, 1]), (True, [3, 3, 3])])
def test_training_data_gives_a_loader_of_micro_batches(drop_last, expected):
    """The last short micro-batch kept, or dropped with DeepSpeed's `dataloader_drop_last`."""
    data = torch.utils.data.TensorDataset(torch.cat(batches(5)))
    extra = {} if drop_last is None else {"dataloader_drop_last": drop_last}
    engine, _, loader, _ = zero.initialize(model=tied_blocks(0), training_data=data,
                                           config=make_config(0, "none", micro=3, **extra))
    try:
        sizes = [len(batch[0]) for batch in loader]
        assert sizes == expected and len(loader) == len(expected)
    finally:
        engine.close()


def test_config_by_older_names(tmp_path):
    """config_params (DeepSpeed's older keyword) and args.deepspeed_config (its argparse convention)."""
    engine, *_ = zero.initialize(model=tied_blocks(0), config_params=make_config(1, "none", accum=2))
    assert engine.gradient_accumulation_steps() == 2
    engine.close()
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(make_config(2, "cpu", accum=3)))
    engine, *_ = zero.initialize(args=argparse.Namespace(deepspeed_config=str(path)), model=tied_blocks(0))
    assert engine.gradient_accumulation_steps() == 3 and engine.stage == 2
    engine.close()
    args = zero.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepscale_config", str(path)])
    engine, *_ = zero.initialize(args=args, model=tied_blocks(0))  # DeepSpeed's older flag, as DeepSpeed maps it
    assert engine.gradient_accumulation_steps() == 3 and engine.stage == 2
    engine.close()
    args.deepspeed_config = str(path)
    with pytest.raises(ConfigError, match="deepscale_config.*keep one"):
        zero.initialize(args=args, model=tied_blocks(0))


def test_missing_model_or_config():
    with pytest.raises(ValueError, match="model"):
        zero.initialize(config=make_config())
    with pytest.raises(ConfigError, match="config"):
        zero.initialize(model=tied_blocks(0))


def test_step_hands_lr_kwargs_to_the_scheduler_at_the_boundary():
    """DeepSpeed's `engine.step(lr_kwargs=...)`: the scheduler's `step(**lr_kwargs)` runs once an accumulation
    boundary's optimizer step has (a Megatron-style scheduler counts tokens so); not between boundaries."""

    class Tokens:
        def __init__(self):
            self.calls = []

        def step(self, **kwargs):
            self.calls.append(kwargs)

        def state_dict(self):
            return {}

    scheduler = Tokens()
    engine, *_ = zero.initialize(model=tiny_gpt2(), config=make_config(2, "cpu", accum=2), lr_scheduler=scheduler)
    try:
        for index, ids in enumerate(batches(4)):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step(lr_kwargs={"increment": 10 * index})
        assert scheduler.calls == [{"increment": 10}, {"increment": 30}]
    finally:
        engine.close()
