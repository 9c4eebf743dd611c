"""Every command the README names, and every bench's defaults, fit the device budget they set: the engine's own
minimum (zero.initialize.device_need: the plan alone, nothing built or written) for the model and config each
runs, on this machine (the compute dtype the main job would switch to here included). A shipped config that
falls short fails here, not after building a 7B model."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from zero.comm import local_device
from zero.config import load_config
from zero.initialize import device_need
from zero.train import run
from zero.train.gpt import GPT

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = [
    [],  # the main job on its built-in default
    ["--config", "configs/zero3_nvme_scale.json", "--preset", "7b", "--layers", "12"],  # the scale command
    *(["--config", str(path), "--preset", "small"] for path in sorted((ROOT / "configs").glob("*.json"))),
]


def fits(argv: list[str], world_size: int = 1) -> tuple[int | None, int]:
    """(the device budget the main job would run `argv` with, the least it needs on each of `world_size` ranks)."""
    args = run.parse_args(argv)
    config = run.load_ds_config(args)
    run.fast_compute(config, args, local_device())
    with torch.device("meta"):
        model = GPT(run.model_config(args))
    budget = load_config(config, world_size=world_size).zero_tiering.device_budget
    return budget, sum(device_need(model, config, world_size).values())


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda argv: " ".join(argv) or "default")
def test_each_readme_command_fits_its_device_budget(argv, monkeypatch):
    monkeypatch.chdir(ROOT)
    budget, need = fits(argv)
    assert budget is None or budget >= need, f"device budget {budget} below the {need} bytes the engine needs"


def test_the_main_job_on_two_ranks_fits_its_device_budget():
    """`torchrun --nproc_per_node 2 -m zero.train` and `python -m zero.launch --num_gpus 2 --module zero.train`."""
    budget, need = fits([], world_size=2)
    assert budget >= need, f"device budget {budget} below the {need} bytes each rank needs"


STREAM = ["--config", "configs/zero3_nvme_scale.json", "--preset", "1b", "--layers", "4", "--seq-len", "256",
          "--host-budget", "1GiB"]
"""bench/stream.py's main-job run at its defaults (the config's own device budget)."""


@pytest.mark.parametrize("argv", [STREAM, ["--config", "configs/zero3_nvme_scale.json", "--preset", "tiny",
                                           "--seq-len", "64", "--host-budget", "8MiB", "--device-budget", "4MiB"]],
                         ids=["stream", "stream-quick"])
def test_stream_bench_defaults_fit(argv, monkeypatch):
    monkeypatch.chdir(ROOT)
    budget, need = fits(argv)
    assert budget >= need, f"device budget {budget} below the {need} bytes the engine needs"


@pytest.mark.parametrize("quick", [False, True], ids=["train", "train-quick"])
def test_train_bench_defaults_fit(quick, tmp_path):
    """bench/train.py's ours-cpu and ours-nvme at their defaults (fp32, 124m; --quick: tiny)."""
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "bench" / "train.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for offload in ("cpu", "nvme"):
        args = run.parse_args(["--preset", "tiny" if quick else "124m"])
        config = bench.ds_config(offload, str(tmp_path), 2)
        config["zero_tiering"] = {"device_budget": bench.QUICK_DEVICE_BUDGET if quick else bench.DEVICE_BUDGET}
        with torch.device("meta"):
            model = GPT(run.model_config(args))
        budget = load_config(config, world_size=1).zero_tiering.device_budget
        need = sum(device_need(model, config).values())
        assert budget >= need, f"{offload}: device budget {budget} below the {need} bytes the engine needs"
