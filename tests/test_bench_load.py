"""bench/load.py --quick runs: a saved model loads into the tiers under a host budget half its size, reporting the
peak RSS beside host budget + 1 GiB."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO_ROOT, child_env


def test_quick_load_bench(tmp_path):
    out = tmp_path / "load.json"
    done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", "load.py"), "--quick", "--dir",
                           str(tmp_path), "--json", str(out)], env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert 0 < record["pool_peak"] <= record["host_budget"] < record["weights_bytes"]
    assert record["nvme_bytes"] >= 4 * record["weights_bytes"]  # the fp32 shard (the master), 2 moments, the gradient
    assert record["peak_rss"] > 0 and record["limit"] == record["host_budget"] + (1 << 30)
