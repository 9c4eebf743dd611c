"""The benchmarks' --quick modes run end to end and write their records (no speed thresholds: the machine is
shared and noisy): bench/infer.py, bench/load.py, bench/adam_stream.py and bench/stream.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO_ROOT, child_env


def quick(script: str, tmp_path) -> dict | list:
    """Run `bench/<script> --quick` with its files under tmp_path; its JSON record."""
    out = tmp_path / "record.json"
    done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", script), "--quick", "--dir",
                           str(tmp_path), "--json", str(out)], env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


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
    result = quick("stream.py", tmp_path)
    fio = result["fio_mixed_gbps"]
    mixed = (fio["before"] + fio["after"]) / 2 * 1e9
    assert result["in_memory_step_s"] > 0 and result["peak_rss_bytes"] > 0 and len(result["losses"]) == 3
    for step in result["steps"]:
        moved = step["read_bytes"] + step["write_bytes"]
        assert abs(step["bound_s"] - max(result["in_memory_step_s"], moved / mixed)) < 1e-9
        assert 0 <= step["disk_idle"] <= 1 and step["vs_bound"] > 0
    assert sum(step["read_bytes"] for step in result["steps"]) > 0  # the quick model does stream through nvme
