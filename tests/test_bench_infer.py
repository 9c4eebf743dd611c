"""bench/infer.py --quick runs: plain transformers, ours with weights in host memory and on nvme generate the same
tokens, each with its prefill, decode rate and peak RSS."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO_ROOT, child_env


def test_quick_inference_bench(tmp_path):
    out = tmp_path / "infer.json"
    done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", "infer.py"), "--quick", "--dir",
                           str(tmp_path), "--json", str(out)], env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tokens_identical"] and [r["system"] for r in result["records"]] == ["torch", "ours-cpu", "ours-nvme"]
    for record in result["records"]:
        assert record["decode_tok_s"] > 0 and record["prefill_s"] > 0 and record["peak_rss"] > 0
    assert result["records"][1]["bound_tok_s"] > 0
