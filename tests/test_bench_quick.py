"""The benchmarks' --quick modes run end to end and write their records (no speed thresholds: the machine is
shared and noisy): bench/infer.py, bench/load.py, bench/adam_stream.py, bench/stream.py, bench/activations.py,
bench/quality.py, bench/lora.py and bench/gpu_check.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO_ROOT, child_env


def quick(script: str, tmp_path, *flags: str, files: bool = True) -> dict | list:
    """Run `bench/<script> --quick` (and `flags`) with its files in a folder under tmp_path that it makes (`files`: it
    takes --dir); its JSON record."""
    out = tmp_path / "record.json"
    directory = ["--dir", str(tmp_path / "not" / "made")] if files else []
    done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", script), "--quick", *directory,
                           "--json", str(out), *flags], env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_dir_that_cannot_be_made_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "file").write_text("")
    done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", "train.py"), "--quick", "--dir",
                           str(tmp_path / "file" / "x")], env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == f"train.py: error: --dir {tmp_path / 'file' / 'x'}: Not a directory"


def test_infer_generates_the_same_tokens_in_every_system(tmp_path):
    result = quick("infer.py", tmp_path)
    assert result["tokens_identical"]
    assert [r["system"] for r in result["records"]] == ["torch", "ours-cpu", "ours-nvme"]
    for record in result["records"]:
        assert record["decode_tok_s"] > 0 and record["prefill_s"] > 0 and record["peak_rss"] > 0
    ours = result["records"][1]
    assert ours["bound_tok_s"] > 0
    # The bus bound is the copy and the in-memory forward one after the other: below either alone.
    assert ours["bus_bound_tok_s"] < min(ours["bound_tok_s"], result["records"][0]["decode_tok_s"])


def test_load_stays_within_the_host_budget(tmp_path):
    record = quick("load.py", tmp_path)
    assert 0 < record["pool_peak"] <= record["host_budget"] < record["weights_bytes"]
    assert record["nvme_bytes"] >= 4 * record["weights_bytes"]  # the fp32 shard (the master), 2 moments, the gradient
    assert record["peak_rss"] > 0 and record["limit"] == record["host_budget"] + (1 << 30)


def test_adam_stream_bound_is_its_bytes_over_the_mixed_rate(tmp_path):
    result = quick("adam_stream.py", tmp_path)
    assert result["mixed_gbps"] > 0 and result["step_s"] > 0
    assert abs(result["io_bound_s"] - 28 * result["elements"] / (result["mixed_gbps"] * 1e9)) < 1e-9


def test_stream_bounds_each_step_by_fio_and_the_in_memory_step(tmp_path):
    """Exact and int8 moments side by side, each step bounded by the same yardstick; the int8 run moves fewer
    bytes per parameter."""
    result = quick("stream.py", tmp_path, "--formats", "fp32/fp32,int8/fp32")
    fio = result["fio_mixed_gbps"]
    mixed = (fio["before"] + fio["after"]) / 2 * 1e9
    assert result["in_memory_step_s"] > 0 and list(result["formats"]) == ["fp32/fp32", "int8/fp32"]
    for run in result["formats"].values():
        assert run["peak_rss_bytes"] > 0 and len(run["losses"]) == 3
        for step in run["steps"]:
            moved = step["read_bytes"] + step["write_bytes"]
            assert abs(step["bound_s"] - max(result["in_memory_step_s"], moved / mixed)) < 1e-9
            assert 0 <= step["disk_idle"] <= 1 and step["vs_bound"] > 0
        assert sum(step["read_bytes"] for step in run["steps"]) > 0  # the quick model does stream through nvme
    assert result["formats"]["int8/fp32"]["bytes_per_param"] < result["formats"]["fp32/fp32"]["bytes_per_param"]


def test_quality_trains_each_format_beside_exact_on_the_same_batches(tmp_path):
    result = quick("quality.py", tmp_path, "--plot", str(tmp_path / "curves.png"), files=False)
    assert list(result["runs"]) == ["exact", "int8/fp32", "bf16/fp32"]
    for name, by_seed in result["runs"].items():
        run = by_seed["0"]
        assert len(run["curve"]) == 4 and run["held_out"] > 0
        assert result["relative"][name] == run["held_out"] / result["runs"]["exact"]["0"]["held_out"] - 1
    assert result["runs"]["int8/fp32"]["0"]["curve"][0] == result["runs"]["exact"]["0"]["curve"][0]  # same batch
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_gpu_check_runs_on_cpu_and_says_what_it_skipped(tmp_path):
    """bench/gpu_check.py with no GPU visible: parity runs on the CPU through the copy worker, the same losses
    with every copy delayed; the GPU-only checks say skipped and why; the report is written."""
    record_path = tmp_path / "x.json"
    done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", "gpu_check.py"), "--quick", "--out",
                           str(tmp_path), "--json", str(record_path), "--dir", str(tmp_path)],
                          env=dict(child_env(), CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(record_path.read_text())
    checks = record["checks"]
    assert record["passed"] and record["machine"]["device"] == "cpu (no CUDA)"
    assert checks["cuda-marked tests"]["status"] == "skipped"
    assert checks["profile of a streamed step"]["status"] == "skipped"
    assert "cuda-marked tests — no CUDA" in record["skipped"]
    assert any(line.startswith("torch.cuda.max_memory_allocated") and "no CUDA" in line for line in record["skipped"])
    runs = checks["ZeRO-3 parity"]["runs"]
    assert [r["run"] for r in runs] == ["cpu/cpu fp32", "cpu/cpu bf16", "nvme/nvme fp32", "nvme/nvme bf16"]
    for run in runs:
        assert run["device"] == "cpu" and run["delayed_copies"] > 0
        assert run["delayed_losses"] == run["losses"] and run["delayed_equal"]
    budgets = checks["budgets"]
    assert budgets["status"] == "passed"
    assert budgets["host_held_bytes"] <= budgets["host_budget_bytes"]
    assert 0 < budgets["device_tier_peak_bytes"] <= budgets["device_budget_bytes"]
    trained = {r["system"]: r for r in checks["bench/train.py"]["runs"]}
    assert set(trained) == {"torch", "ours-cpu", "ours-nvme"}
    for run in trained.values():  # a step's disk bytes and ours' gradients through nvme (none: no host budget here)
        assert [type(run[k]) for k in ("disk_read_bytes", "disk_written_bytes", "grad_nvme_bytes")] == [int] * 3
        assert run["grad_nvme_bytes"] == 0
    report = (tmp_path / "gpu_check.md").read_text()
    assert "skipped: cuda-marked tests — no CUDA" in report and "## 2. ZeRO-3 parity: passed" in report


def test_activations_bench_trains_the_same_losses_in_every_mode(tmp_path):
    result = quick("activations.py", tmp_path)
    assert result["losses_identical"]
    records = result["records"]
    assert list(records) == ["none", "device", "cpu", "nvme"]
    assert records["none"]["activations"] is None
    for mode in ("device", "cpu", "nvme"):
        assert records[mode]["activations"] > 0 and records[mode]["device_peak"] > 0
    for mode in ("cpu", "nvme"):  # held to the device run's peak, and the activations left the device
        assert records[mode]["device_peak"] <= records[mode]["device_budget"] == records["device"]["device_peak"]
        assert records[mode]["bytes_moved"]["device->host"] >= records[mode]["activation_bytes"]
    assert records["nvme"]["bytes_moved"].get("host->nvme", 0) > 0


def test_lora_reads_its_base_and_never_writes_it(tmp_path):
    """The quick Llama's base streams from nvme (the host budget cannot keep it beside the adapters' state): read
    every step, not a byte of it written; each step bounded by the bytes it read over fio's read rate, or the
    in-memory step in its compute dtype. Stored in bf16 the base is half its fp32 bytes, as int8 about a quarter;
    the int8 logits' difference from the bf16 base's is measured."""
    result = quick("lora.py", tmp_path, "--bases", "fp32,bf16,int8")
    fio = result["fio_read_gbps"]
    rate = (fio["before"] + fio["after"]) / 2 * 1e9
    runs = result["runs"]
    assert list(runs) == ["fp32", "bf16", "int8"] and list(result["in_memory_step_s"]) == ["bf16", "fp32"]
    for name, run in runs.items():
        compute = result["in_memory_step_s"]["bf16" if name == "bf16" else "fp32"]
        assert run["frozen_bytes"] > 0 and run["peak_rss_bytes"] > 0 and run["host_peak"] <= run["host_budget"]
        assert sum(step["frozen_read"] for step in run["steps"]) > 0  # (the int8 base: the host keeps it after)
        for step in run["steps"]:
            assert step["frozen_written"] == 0 and step["read"] >= step["frozen_read"]
            assert abs(step["bound_s"] - max(compute, step["read"] / rate)) < 1e-9
    assert all(step["frozen_read"] > 0 for step in runs["fp32"]["steps"])
    assert runs["bf16"]["frozen_bytes"] == runs["fp32"]["frozen_bytes"] / 2
    assert runs["int8"]["frozen_bytes"] < runs["fp32"]["frozen_bytes"] / 3
    for ratio in ("mean_relative", "max_relative"):  # moved, and by what block-wise int8 moves weights (~1%)
        assert 0 < result["int8_logits"][ratio] < 0.1


def test_train_bench_in_bf16_runs_our_smallest_state_beside_exact(tmp_path):
    """`--dtype bf16` and `ours-nvme-int8-sr`: int8 moments and the bf16 shard as the master, so no master segment
    moves, where the exact run moves one (a 1 MiB host budget: everything streams)."""
    out = tmp_path / "train.json"
    done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", "train.py"), "--preset", "tiny", "--steps",
                           "1", "--warmup", "1", "--seq-len", "8", "--dtype", "bf16", "--systems",
                           "ours-nvme,ours-nvme-int8-sr", "--device-budget", "64MiB", "--host-budget", "1MiB",
                           "--dir", str(tmp_path), "--json", str(out)],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    exact, compact = (r["segment_kinds"] for r in json.loads(out.read_text()))
    assert exact["host->nvme master"] > 0 and not any(kind.endswith("master") for kind in compact), compact
    assert 0 < compact["host->nvme exp_avg"] < exact["host->nvme exp_avg"] / 2, (compact, exact)
