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


@pytest.mark.filterwarnings("ignore::zero.compute_speed.SlowComputeWarning")
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
        for p in model.parameters():  # DeepSpeed's partition of one rank: all of it, swapped out
            assert p.ds_tensor.numel() == 0 and p.ds_tensor.ds_numel == p.ds_numel == p.ds_shape.numel()
        assert sum(p.ds_numel for p in model.parameters() if hasattr(p, "ds_tensor")) == 2 * (8 * 8 + 8)
    finally:
        engine.close()


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
    init_distributed, as it may under DeepSpeed."""
    script = textwrap.dedent("""
        import os, torch.distributed as dist, zero
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
            os.environ.pop(name, None)
        zero.init_distributed()
        dist.barrier()
        print(dist.get_rank(), dist.get_world_size(), dist.get_backend())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0", "1", "gloo"]


def test_the_main_job_takes_the_launchers_local_rank():
    assert run.parse_args(["--local_rank", "0", "--steps", "2"]).steps == 2
    assert run.parse_args(["--local-rank=1"]).local_rank == 1
