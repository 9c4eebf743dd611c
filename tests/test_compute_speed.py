"""A compute dtype that is slow on the machine at hand is named before training (measured, with what to use
instead), the main job switches to a fast one unless --dtype asks for the slow one, and the planner and the
report say the same. Which dtypes torch runs natively here comes from torch's own oneDNN queries."""
from __future__ import annotations

import json
import os

import pytest
import torch

from zero.services.compute_speed import dtype_speed, fast_alternative
from zero.plan.__main__ import main as plan_main
from zero.report.__main__ import main as report_main
from zero.train import main as train_main
from zero.train.run import fast_compute, load_ds_config, parse_args

from conftest import REPO_ROOT
from models import one_thread  # noqa: F401  (autouse fixture)

FP16_NATIVE = torch.ops.mkldnn._is_mkldnn_fp16_supported()
BF16_NATIVE = torch.ops.mkldnn._is_mkldnn_bf16_supported()
slow_fp16 = pytest.mark.skipif(FP16_NATIVE, reason="this CPU runs fp16 matrix products natively")
fast_bf16 = pytest.mark.skipif(not BF16_NATIVE, reason="this CPU has no native bf16 matrix products")
ZERO1 = os.path.join(REPO_ROOT, "configs", "zero1.json")  # fp16, written for a GPU


def test_fp32_is_the_yardstick():
    assert dtype_speed(torch.float32).slowdown == 1.0 and not dtype_speed(torch.float32).slow


@slow_fp16
def test_fp16_on_a_cpu_without_fp16_kernels_is_slow():
    speed = dtype_speed(torch.float16)
    assert speed.slow, f"fp16 matmuls took {speed.slowdown:.1f}x fp32's on a CPU torch has no fp16 kernels for"


@fast_bf16
def test_native_bf16_is_fast_and_is_the_alternative():
    assert not dtype_speed(torch.bfloat16).slow
    assert fast_alternative() == torch.bfloat16


@slow_fp16
def test_the_main_job_names_a_slow_dtype_and_trains_in_a_fast_one(tmp_path, capsys):
    run = train_main(["--config", ZERO1, "--preset", "tiny", "--steps", "1", "--nvme-path", str(tmp_path)])
    out = capsys.readouterr().out
    instead = "bf16" if BF16_NATIVE else "fp32"
    assert f"fp16 compute (from {ZERO1}) is slow on this CPU" in out
    assert f"use {instead};" in out and f"training in {instead} (--dtype fp16 keeps fp16)" in out
    assert f"compute {'bfloat16' if BF16_NATIVE else 'float32'}" in out, "the model line names the dtype trained in"
    assert len(run.reports) == 1


@slow_fp16
def test_dtype_flag_keeps_a_slow_dtype_and_says_so():
    args = parse_args(["--config", ZERO1, "--dtype", "fp16"])
    config = load_ds_config(args)
    line = fast_compute(config, args, torch.device("cpu"))
    assert "fp16 compute (from --dtype fp16) is slow" in line and line.endswith("kept, as --dtype asks")
    assert config["fp16"]["enabled"] and not config["bf16"]["enabled"]
    assert config["fp16"]["initial_scale_power"] == 16, "the rest of the fp16 section is kept"


@pytest.mark.parametrize("flag", [[], ["--dtype", "fp32"]])
def test_a_fast_dtype_meets_no_line(flag):
    args = parse_args(flag)  # the built-in default asks for bf16
    config = load_ds_config(args)
    asked = config["bf16"]["enabled"]
    if asked and not BF16_NATIVE:
        pytest.skip("this CPU has no native bf16 matrix products")
    assert fast_compute(config, args, torch.device("cpu")) is None
    assert config["bf16"]["enabled"] == asked


@slow_fp16
def test_the_planner_prices_a_slow_dtype_and_says_so(tmp_path):
    common = ["--model", "tiny", "--nvme-path", str(tmp_path), "--disk-read", "2", "--disk-write", "2.5", "--json"]
    fp16 = plan_main([*common, "--precision", "fp16"])
    fp32 = plan_main([*common, "--precision", "fp32"])
    assert fp16["slow_compute"].startswith("fp16 compute (from precision fp16) is slow")
    assert fp32["slow_compute"] is None
    assert fp16["machine"]["matmul_flops"] < fp32["machine"]["matmul_flops"] / 2


def test_the_report_shows_which_dtypes_are_fast(tmp_path, capsys):
    report_main(["--nvme-path", str(tmp_path), "--json"])
    check = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}["compute dtypes"]
    assert ("fp16" in check["fix"]) == dtype_speed(torch.float16).slow
    assert check["verdict"] == ("WARN" if dtype_speed(torch.float16).slow or dtype_speed(torch.bfloat16).slow
                                else "OK")
    assert "bf16" in check["found"] and "fp16" in check["found"]
