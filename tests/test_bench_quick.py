"""The benchmarks' --quick modes run end to end and write their records (no speed thresholds: the machine is
shared and noisy): bench/infer.py, bench/load.py and bench/adam_stream.py."""
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
    assert result["records"][1]["bound_tok_s"] > 0


def test_load_stays_within_the_host_budget(tmp_path):
    record = quick("load.py", tmp_path)
    assert 0 < record["pool_peak"] <= record["host_budget"] < record["weights_bytes"]
    assert record["nvme_bytes"] >= 4 * record["weights_bytes"]  # the fp32 shard (the master), 2 moments, the gradient
    assert record["peak_rss"] > 0 and record["limit"] == record["host_budget"] + (1 << 30)


def test_adam_stream_bound_is_its_bytes_over_the_mixed_rate(tmp_path):
    result = quick("adam_stream.py", tmp_path)
    assert result["mixed_gbps"] > 0 and result["step_s"] > 0
    assert abs(result["io_bound_s"] - 28 * result["elements"] / (result["mixed_gbps"] * 1e9)) < 1e-9
