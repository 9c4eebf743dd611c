"""What scripts written for DeepSpeed read of the engine and of partitioned parameters, and what they expect of
`init_distributed` and of the command line: DeepSpeed's names and behaviour."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import zero
from zero.integrations.unsupported import UnsupportedFeatureError
from zero.train import run


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.checkpointing = False

    def gradient_checkpointing_enable(self) -> None:
        self.checkpointing = True

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def engine_for(stage: int, dtype: str = "fp32", accumulation: int = 1):
    torch.manual_seed(0)
    model = Net()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulation,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "bf16": {"enabled": dtype == "bf16"}}
    return zero.initialize(model=model, model_parameters=model.parameters(), config=config)[0], model


@pytest.mark.filterwarnings("ignore::zero.services.compute_speed.SlowComputeWarning")
def test_the_engine_answers_what_deepspeed_scripts_ask(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    engine, model = engine_for(3, "bf16")
    try:
        assert engine.bfloat16_enabled() and not engine.fp16_enabled()
        assert engine.local_rank == 3
        engine.gradient_checkpointing_enable()  # the model's own method, through the engine
        assert model.checkpointing
        assert engine.layers is model.layers
        with pytest.raises(AttributeError, match="no_such_thing"):
            engine.no_such_thing
        # A DeepSpeedEngine method ours lacks is named as DeepSpeed's, not blamed on the user's model
        assert not hasattr(engine, "memory_breakdown")
        with pytest.raises(UnsupportedFeatureError, match=r"DeepSpeedEngine\.memory_breakdown"):
            engine.memory_breakdown()
        for p in model.parameters():  # DeepSpeed's partition of one rank: all of it, swapped out
            assert p.ds_tensor.numel() == 0 and p.ds_tensor.ds_numel == p.ds_numel == p.ds_shape.numel()
        assert sum(p.ds_numel for p in model.parameters() if hasattr(p, "ds_tensor")) == 2 * (8 * 8 + 8)
    finally:
        engine.destroy()  # DeepSpeed's name for close()
    assert engine._closed


def test_tput_timer_counts_the_steps_after_its_start_step():
    engine, _ = engine_for(0, accumulation=2)
    try:
        assert engine.tput_timer.avg_samples_per_sec() == -1.0
        x = torch.randn(2, 8)
        for _ in range(2 * 4):  # 4 optimizer steps of 2 micro-batches
            engine.backward(engine(x))
            engine.step()
        timer = engine.tput_timer
        assert timer.global_step_count == 4 and timer.micro_step_count == 8
        assert timer.avg_samples_per_sec() == pytest.approx(engine.train_batch_size() * 2 / timer.total_elapsed_time)
        timer.update_epoch_count()
        assert timer.epoch_count == 1 and timer.micro_step_count == 0
    finally:
        engine.close()


def test_init_distributed_alone_joins_a_group_of_one():
    """A script run without a launcher calls its own torch.distributed.get_rank() and barrier() after
    init_distributed, as it may under DeepSpeed, and the engine's data-parallel group is that group."""
    script = textwrap.dedent("""
        import os, torch, torch.distributed as dist, zero
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
            os.environ.pop(name, None)
        zero.init_distributed()
        dist.barrier()
        print(dist.get_rank(), dist.get_world_size(), dist.get_backend())
        model = torch.nn.Linear(4, 4)
        engine, *_ = zero.initialize(model=model, model_parameters=model.parameters(), config={
            "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
        group = engine.data_parallel_group
        print(group is dist.group.WORLD, group.rank(), group.size(), engine.global_rank, engine.dp_world_size)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0", "1", "gloo", "True", "0", "1", "0", "1"]


def test_the_engine_names_its_ranks_as_deepspeeds_does():
    """global_rank, world_size, dp_world_size, data_parallel_group, training_dataloader: DeepSpeedEngine's
    attributes, which scripts read to log on one rank or shard their own data (on one rank without a process
    group, no group); model, sequence and pipeline parallelism are absent: size 1."""
    model = nn.Linear(4, 4)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4))
    engine, _, loader, _ = zero.initialize(model=model, model_parameters=model.parameters(), training_data=data,
                                           config={"train_batch_size": 2,
                                                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    try:
        assert (engine.global_rank, engine.world_size, engine.dp_world_size) == (0, 1, 1)
        assert (engine.mp_world_size, engine.seq_dp_world_size, engine.sequence_parallel_size) == (1, 1, 1)
        assert engine.data_parallel_group is None and engine.mpu is None
        assert engine.training_dataloader is loader and len(loader) == 4
    finally:
        engine.close()


def test_the_main_job_takes_the_launchers_local_rank():
    assert run.parse_args(["--local_rank", "0", "--steps", "2"]).steps == 2
    assert run.parse_args(["--local-rank=1"]).local_rank == 1


UNCHANGED = textwrap.dedent("""
    import argparse, torch
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.compression.helper import recursive_getattr
    from deepspeed.pipe import PipelineModule  # imported, never built

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters())})
    engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=groups, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3}})
    loss = engine(torch.ones(2, 4)).sum()
    engine.backward(loss)
    engine.step()
    assert recursive_getattr(engine.module, "0") is model[0]
    assert deepspeed.initialize.__module__ == "zero.initialize" and get_accelerator().device_name() in ("cpu", "cuda")
    print("RAN", args.local_rank, dist.get_rank(), dist.get_world_size(), FusedAdam.__module__)
""")


def test_the_launcher_runs_a_deepspeed_script_with_no_line_changed(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(UNCHANGED)
    from stage3_models import free_port

    done = subprocess.run([sys.executable, "-m", "zero.launch", "--num_gpus", "1", "--master_port", str(free_port()),
                           str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "RAN 0 0 1 zero.ops.adam" in done.stdout


def test_the_alias_refuses_a_process_that_imported_the_real_deepspeed(monkeypatch):
    from zero.integrations import deepspeed_alias

    monkeypatch.setitem(sys.modules, "deepspeed", object())
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, deepspeed_alias.DeepSpeedAlias)])
    with pytest.raises(ImportError, match="already imported"):
        deepspeed_alias.install()


def test_deepspeeds_defaults_clip_at_one_and_shuffle_on_one_rank():
    """A config without gradient_clipping clips at 1.0 (DeepSpeed 0.19.3+); the training_data loader shuffles with a
    DistributedSampler (seed 0) on one rank, as DeepSpeed's does."""
    from zero.config import load_config

    assert load_config({"train_micro_batch_size_per_gpu": 1}).gradient_clipping == 1.0
    assert load_config({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0}).gradient_clipping == 0.0
    data = torch.utils.data.TensorDataset(torch.arange(10.0))
    model = nn.Linear(1, 1)
    _, _, loader, _ = zero.initialize(model=model, model_parameters=model.parameters(), training_data=data, config={
        "train_micro_batch_size_per_gpu": 10, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    order = next(iter(loader))[0].tolist()
    expected = list(torch.utils.data.distributed.DistributedSampler(data, 1, 0))
    assert order == [float(i) for i in expected] and order != sorted(order)


class WithTable(nn.Module):
    """A rotary-style fp32 table beside its layer."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return (x.float() * self.inv_freq.repeat(2)).sum()


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.filterwarnings("ignore::zero.services.compute_speed.SlowComputeWarning")
def test_floating_buffers_keep_their_dtype_under_bf16(stage):
    torch.manual_seed(0)
    model = WithTable()
    table = model.inv_freq.clone()
    engine, *_ = zero.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}})
    try:
        assert model.inv_freq.dtype == torch.float32 and torch.equal(model.inv_freq, table)
        engine.backward(engine(torch.ones(1, 8, dtype=torch.bfloat16)))
        engine.step()
        with zero.zero.GatheredParameters(list(model.parameters())):
            assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    finally:
        engine.close()
