"""DeepSpeed's helpers that scripts import from `deepspeed.utils` and `deepspeed.runtime`, real here: RepeatingLoader,
the logger and log_dist, the ZeRO-3 leaf-module marks (which change nothing our units do: a marked MoE block trains
bit for bit as unmarked), set_random_seed, see_memory_usage, the offload enums and DeepSpeedConfig."""
from __future__ import annotations

import logging
import random

import numpy
import pytest
import torch
from torch import nn

import zero
from zero.config import ConfigError
from zero.integrations.unsupported import UnsupportedFeatureError
from zero.runtime.utils import see_memory_usage, set_random_seed
from zero.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from zero.utils import (RepeatingLoader, get_z3_leaf_modules, log_dist, logger, set_z3_leaf_modules,
                        set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules,
                        z3_leaf_module)


def test_repeating_loader_restarts_its_loader_at_the_end():
    loader = torch.utils.data.DataLoader(torch.arange(6), batch_size=2)
    batches = RepeatingLoader(loader)
    assert iter(batches) is batches
    assert [next(batches).tolist() for _ in range(5)] == [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3]]
    assert zero.runtime.dataloader.RepeatingLoader is RepeatingLoader  # where DeepSpeed has it too


def test_logger_and_log_dist(caplog):
    assert isinstance(logger, logging.Logger) and zero.logger is logger
    with caplog.at_level(logging.INFO, logger=logger.name):
        log_dist("hello", ranks=[0])  # no process group: logged, as rank -1
    assert caplog.messages == ["[Rank -1] hello"]


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class SparseMoeBlock(nn.Module):
    """Routes each row to one expert: which experts run changes from step to step."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 2)
        self.experts = nn.ModuleList(Expert() for _ in range(2))

    def forward(self, x):
        choice = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = (choice == i).nonzero()[:, 0]
            if len(rows):  # an expert no row chose does not run
                out = out.index_add(0, rows, expert(x[rows]))
        return out


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mlp = SparseMoeBlock()

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class MoeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


def test_leaf_marks_are_deepspeeds():
    model = MoeNet()
    blocks = [layer.mlp for layer in model.layers]
    assert set_z3_leaf_modules(model, [SparseMoeBlock]) == blocks
    assert get_z3_leaf_modules(model) == blocks and z3_leaf_module(blocks[0]) and not z3_leaf_module(model)
    assert unset_z3_leaf_modules(model, ["SparseMoeBlock"]) == blocks and get_z3_leaf_modules(model) == []
    assert set_z3_leaf_modules(model, [f"{__name__}.Expert"]) == [e for b in blocks for e in b.experts]
    unset_z3_leaf_modules(model, [Expert])
    assert set_z3_leaf_modules_by_name(model, ["layers.1.mlp", "nope"], raise_if_not_found=False) == ([blocks[1]],
                                                                                                      ["nope"])
    assert set_z3_leaf_modules_by_suffix(model, ["2.mlp"]) == ([blocks[2]], [])
    with pytest.raises(ValueError, match="No modules of type"):
        set_z3_leaf_modules(model, [nn.Conv1d])
    with pytest.raises(ValueError, match=r"No modules named \['nope'\]"):
        set_z3_leaf_modules_by_name(model, ["nope"])


def losses(mark: bool) -> list[float]:
    torch.manual_seed(0)
    model = MoeNet()
    if mark:
        set_z3_leaf_modules(model, [SparseMoeBlock])
    engine, *_ = zero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"},
                              "stage3_param_persistence_threshold": 0}})
    gen = torch.Generator().manual_seed(1)
    out = []
    try:
        for _ in range(3):
            loss = engine(torch.randn(4, 8, generator=gen))
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
    finally:
        engine.close()
    return out


def test_a_marked_moe_block_trains_as_unmarked():
    """The SuperOffload MoE recipe marks each MoE block a leaf: each is within one decoder layer, which is one unit,
    gathered whole before it runs; the mark changes nothing."""
    assert losses(mark=True) == losses(mark=False)


def test_set_random_seed_seeds_python_numpy_and_torch():
    draws = []
    for _ in range(2):
        set_random_seed(2**64 + 5)  # DeepSpeed's reductions: numpy modulo 2**32, torch modulo 2**63
        draws.append((random.random(), numpy.random.rand(), torch.rand(1).item()))
    assert draws[0] == draws[1]
    assert zero.runtime.utils.set_random_seed is set_random_seed  # as `deepspeed.runtime.utils.set_random_seed`


def test_see_memory_usage_reports_only_when_forced(capsys):
    see_memory_usage("before")
    assert capsys.readouterr().out == ""
    see_memory_usage("after load", force=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "after load" and lines[1].startswith("MA ") and " Max_CA " in lines[1]
    assert lines[2].startswith("CPU Virtual Memory:  used = ") and lines[2].endswith("%")


def test_offload_enums_are_deepspeeds():
    assert [e.value for e in OffloadDeviceEnum] == ["none", "cpu", "nvme"] and OffloadDeviceEnum.cpu == "cpu"
    assert [e.value for e in OffloadStateTypeEnum] == ["optim_states", "hp_params", "lp_params", "lp_grads",
                                                       "contiguous_grad_buffer"]


def test_deepspeed_config_reads_through_our_loader():
    config = zero.DeepSpeedConfig({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                                   "fp16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) \
        == (6, 2, 3)
    assert config.fp16_enabled and not config.bfloat16_enabled and config.zero_optimization_stage == 2
    assert config.sparse_attention is None
    with pytest.raises(ConfigError, match="sparse_attention"):
        zero.DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "sparse_attention": {"mode": "fixed"}})
    with pytest.raises(UnsupportedFeatureError, match=r"^deepspeed.DeepSpeedConfig\(mpu=...\)"):
        zero.DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1}, mpu=object())


def test_save_without_random_ltd_is_the_engine_s_whole_weights_under_plain_names(tmp_path):
    """DeepSpeed's data-efficiency example saves through it: an engine's weights gathered whole (stage 3 here,
    where module.state_dict() would hold placeholders), names free of random-LTD's `.random_ltd_layer`."""
    from stage3_models import full_state, stage3_config, tiny_gpt2
    from zero.runtime.data_pipeline.data_routing.helper import remove_random_ltd_state_dict, save_without_random_ltd

    engine, *_ = zero.initialize(model=tiny_gpt2(), config=stage3_config("cpu", "cpu"))
    try:
        saved, whole = save_without_random_ltd(engine), full_state(engine)
        assert saved.keys() == whole.keys() and all(torch.equal(saved[k], v) for k, v in whole.items())
    finally:
        engine.close()
    value = torch.ones(1)
    assert remove_random_ltd_state_dict({"h.0.random_ltd_layer.attn.weight": value, "wte.weight": value}) == {
        "h.0.attn.weight": value, "wte.weight": value}
