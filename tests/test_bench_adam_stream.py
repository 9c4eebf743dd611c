"""bench/adam_stream.py --quick runs: Adam streamed from nvme beside its I/O bound, the 28 bytes an element moves
over the mixed rate measured on the same store in the same run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO_ROOT, child_env


def test_quick_adam_stream_bench(tmp_path):
    out = tmp_path / "stream.json"
    done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", "adam_stream.py"), "--quick",
                           "--dir", str(tmp_path), "--json", str(out)], env=child_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["mixed_gbps"] > 0 and result["step_s"] > 0
    assert abs(result["io_bound_s"] - 28 * result["elements"] / (result["mixed_gbps"] * 1e9)) < 1e-9
