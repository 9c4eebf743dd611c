"""DeepSpeed's memory estimators (`deepspeed.runtime.zero.stage_1_and_2`, `.stage3`) import by their paths, print
DeepSpeed's table, and count what zero-tiering's engine holds: the host and device bytes a real `zero.initialize`
accounts for on a small model, and, for larger ones known by counts, the engine's rules written out here per
parameter, the partitioned parts divided by the GPUs of every node.
"""
from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import zero as deepspeed
from zero.optim.gradient_copies import SLOTS

stage2 = deepspeed.runtime.zero.stage_1_and_2
stage3 = deepspeed.runtime.zero.stage3
H = 256
ROOT, BLOCK = 2 * 512 * H, 8 * H * H  # the embedding and head; a block's two linears (multiples of 2048: whole pages)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, 4 * H, bias=False)
        self.out = nn.Linear(4 * H, H, bias=False)

    def forward(self, x):
        return x + self.out(torch.relu(self.fc(x)))


class Net(nn.Module):
    def __init__(self, blocks: int = 2):
        super().__init__()
        self.emb = nn.Embedding(512, H)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(H, 512, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_estimators_import_by_deepspeeds_paths():
    from zero.runtime.zero.stage3 import (estimate_zero3_model_states_mem_needs,
                                          estimate_zero3_model_states_mem_needs_all_cold,
                                          estimate_zero3_model_states_mem_needs_all_live)
    from zero.runtime.zero.stage_1_and_2 import (estimate_zero2_model_states_mem_needs,
                                                 estimate_zero2_model_states_mem_needs_all_cold,
                                                 estimate_zero2_model_states_mem_needs_all_live)
    assert stage3.estimate_zero3_model_states_mem_needs_all_live is estimate_zero3_model_states_mem_needs_all_live
    assert stage2.estimate_zero2_model_states_mem_needs_all_live is estimate_zero2_model_states_mem_needs_all_live
    assert all(map(callable, (estimate_zero3_model_states_mem_needs, estimate_zero3_model_states_mem_needs_all_cold,
                              estimate_zero2_model_states_mem_needs, estimate_zero2_model_states_mem_needs_all_cold)))


def table(out: str) -> tuple[list[str], list[tuple[float, float, str]]]:
    """The header lines and the rows (per CPU GB, per GPU GB, options) of a printed table."""
    lines = out.splitlines()
    rows = [re.fullmatch(r" +(\d+\.\d\d)GB \| +(\d+\.\d\d)GB \| (.+)", line) for line in lines[4:]]
    assert all(rows), lines
    return lines[:4], [(float(m[1]), float(m[2]), m[3]) for m in rows]


def test_tables_have_deepspeeds_rows(capsys):
    stage2.estimate_zero2_model_states_mem_needs_all_cold(total_params=2851e6, num_gpus_per_node=8, num_nodes=1)
    header, rows = table(capsys.readouterr().out)
    assert header == ["Estimated memory needed for params, optim states and gradients for a:",
                      "HW: Setup with 1 node, 8 GPUs per node.", "SW: Model with 2851M total params.",
                      "  per CPU  |  per GPU |   Options"]
    assert [options for *_, options in rows] == ["offload_optimizer=cpu", "offload_optimizer=none"]

    stage3.estimate_zero3_model_states_mem_needs_all_live(Net(), num_gpus_per_node=2, num_nodes=2)
    header, rows = table(capsys.readouterr().out)
    assert header[1:3] == ["HW: Setup with 2 nodes, 2 GPUs per node.",
                           "SW: Model with 1M total params, 0M largest layer params."]
    assert [options for *_, options in rows] == [
        "offload_param=cpu , offload_optimizer=cpu , zero_init=1",
        "offload_param=cpu , offload_optimizer=cpu , zero_init=0",
        "offload_param=none, offload_optimizer=cpu , zero_init=1",
        "offload_param=none, offload_optimizer=cpu , zero_init=0",
        "offload_param=none, offload_optimizer=none, zero_init=1",
        "offload_param=none, offload_optimizer=none, zero_init=0"]


def engine_bytes(model: nn.Module, stage: int, offload_param: str, offload_optimizer: str) -> tuple[int, int]:
    """What a real `initialize` of `model` (one rank, bf16) accounts for: per CPU, the larger of the fp32 model the
    script built and the least host budget it accepts; per GPU, the least device budget it computes and, below
    stage 3, the bf16 parameters and their autograd gradients (2 + 2 bytes each). The units are whole pages, so the
    CPU stand-in's page-rounded device charges are the GPU's bytes."""
    n = sum(p.numel() for p in model.parameters())
    zo = {"stage": stage, "offload_optimizer": {"device": offload_optimizer}}
    if stage == 3:
        zo["offload_param"] = {"device": offload_param}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 on a CPU is slow, and says so
        engine, *_ = deepspeed.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": zo,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    try:
        return (max(4 * n, engine.swap.config.host_budget - engine.swap.pool.spare),
                sum(engine.device_minimum.values()) + (4 * n if stage == 2 else 0))
    finally:
        engine.destroy()


def live_row(capsys, model: nn.Module, stage: int, options: str) -> tuple[float, float]:
    """(per CPU, per GPU) of `model`'s live table row `options`, the CPU column in bytes (additional_buffer_factor
    2**30 undoes the GiB) and the GPU column in GiB."""
    if stage == 2:
        stage2.estimate_zero2_model_states_mem_needs_all_live(model, additional_buffer_factor=2**30)
    else:
        stage3.estimate_zero3_model_states_mem_needs_all_live(model, additional_buffer_factor=2**30)
    return next((cpu, gpu) for cpu, gpu, row in table(capsys.readouterr().out)[1] if row == options)


@pytest.mark.parametrize("stage, offload_param, offload_optimizer", [
    (3, "cpu", "cpu"), (3, "none", "cpu"), (3, "none", "none"), (2, "none", "cpu"), (2, "none", "none")])
def test_numbers_are_what_the_engine_accounts(capsys, stage, offload_param, offload_optimizer):
    host, device = engine_bytes(Net(), stage, offload_param, offload_optimizer)
    if stage == 3:
        options = f"offload_param={offload_param:4}, offload_optimizer={offload_optimizer:4}, zero_init=0"
        cpu_mem, gpu_mem, gathered = stage3.estimate_zero3_model_states_mem_needs(  # blocks of BLOCK, the rest root
            ROOT + 2 * BLOCK, BLOCK, cpu_offload=offload_optimizer == "cpu",
            cpu_offload_params=offload_param == "cpu", zero_init=False, additional_buffer_factor=1)
        assert (cpu_mem, gpu_mem) == (host, device)
        assert gathered == 2 * 2 * (ROOT + BLOCK)  # the root and a block gathered in bf16, and their gradients
    else:
        options = f"offload_optimizer={offload_optimizer}"
        one_unit = Net(blocks=0)  # from a count alone the model is one unit
        assert stage2.estimate_zero2_model_states_mem_needs(
            ROOT, cpu_offload=offload_optimizer == "cpu", additional_buffer_factor=1) == engine_bytes(
            one_unit, stage, offload_param, offload_optimizer)
    assert live_row(capsys, Net(), stage, options) == (host, round(device / 2**30, 2))


def test_a_model_built_under_zero_init_or_trained_is_counted_whole(capsys):
    """Partitioned parameters (zero.Init's, then an engine's 0-element placeholders) count by their ds_numel."""
    stage3.estimate_zero3_model_states_mem_needs_all_live(Net())
    plain = capsys.readouterr().out
    with deepspeed.zero.Init(config_dict_or_path={"train_micro_batch_size_per_gpu": 1,
                                                  "zero_optimization": {"stage": 3}}):
        model = Net()
    assert stage3.model_to_params(model) == (ROOT + 2 * BLOCK, 4 * H * H)  # DeepSpeed's largest layer: a linear
    stage3.estimate_zero3_model_states_mem_needs_all_live(model)
    assert capsys.readouterr().out == plain
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = deepspeed.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                  "offload_optimizer": {"device": "cpu"}},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    try:
        assert sum(p.numel() for p in engine.module.parameters()) == 0
        stage3.estimate_zero3_model_states_mem_needs_all_live(engine.module)
        assert capsys.readouterr().out == plain
    finally:
        engine.destroy()


@pytest.mark.parametrize("gpus, nodes", [(1, 1), (2, 2), (8, 1)])
def test_partitioned_parts_divide_by_every_gpu(gpus, nodes):
    """The engine's rules per parameter, written out for 8 blocks of L (no root unit; L / GPUs whole pages): with
    offload, each rank homes 16 bytes of state and gradient (+ 2 of bf16 shard with offload_param) per parameter of
    its 1/GPUs share and stages SLOTS of its sub-groups' bf16 gradients; the device gathers a block and its gradient
    and keeps the reduction's scratch; without offload the device holds that share's bf16 shard, fp32 master and
    moments and bf16 gradient (2 + 12 + 2). A node's CPU holds its GPUs' ranks."""
    w, L = gpus * nodes, 1 << 20
    n = 8 * L
    both = stage3.estimate_zero3_model_states_mem_needs(n, L, gpus, nodes, cpu_offload=True, cpu_offload_params=True,
                                                        zero_init=True, additional_buffer_factor=1)
    staging = SLOTS * 2 * L // w
    assert both == (gpus * (18 * n // w + staging), 4 * L + SLOTS * 2 * L + (staging if w > 1 else 0), 4 * L)
    device_only = stage3.estimate_zero3_model_states_mem_needs(n, L, gpus, nodes, cpu_offload=False, zero_init=True,
                                                               additional_buffer_factor=1)
    scratch = 2 * L + 4 * L + (2 * L // w if w > 1 else 0)  # the reduction's, its reduce-scatter's, the fp32 cast
    assert device_only == (gpus * 4 * n // w, 16 * n // w + 4 * L + scratch, 4 * L)
    cold = stage3.estimate_zero3_model_states_mem_needs(n, L, gpus, nodes, cpu_offload=False, zero_init=False,
                                                        additional_buffer_factor=1.5)
    assert cold[0] == int(1.5 * gpus * 4 * n)  # each rank builds the fp32 model before initialize

    # ZeRO-2, the model one unit: its bf16 parameters and their gradients stay whole on every GPU.
    staging = SLOTS * 2 * n // w
    offloaded = stage2.estimate_zero2_model_states_mem_needs(n, gpus, nodes, cpu_offload=True,
                                                             additional_buffer_factor=1)
    assert offloaded == (gpus * max(4 * n, 16 * n // w + staging), 4 * n + SLOTS * 2 * n + (staging if w > 1 else 0))
    on_device = stage2.estimate_zero2_model_states_mem_needs(n, gpus, nodes, cpu_offload=False,
                                                             additional_buffer_factor=1)
    assert on_device == (gpus * 4 * n, 4 * n + 14 * n // w + 6 * n + (2 * n // w if w > 1 else 0))
