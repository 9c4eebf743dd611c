"""bench/tiers.py --quick runs end to end: its JSON records carry the agreed keys with sane types (scripts
read these names), the plot is written, fio is measured beside us where installed, a store striped over two
directories is measured beside fio on the first, and every file the profiler made is gone afterwards. No
speed thresholds: the disk is shared and noisy."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from conftest import REPO_ROOT, child_env

from tiering.engines import load_aio
from tiering.errors import EngineUnavailableError

REQUIRED = {"pair": str, "direction": str, "engine": str, "block_size": int, "queue_depth": int, "bytes": int,
            "seconds": float, "gbps": float}
LAYOUT = {"dirs": int, "segments": int}
"""Keys of host-nvme records: the directories the bytes were spread over, the extents a transfer was cut into."""


def run_quick(directory, out, *more_dirs) -> tuple[list[dict], str]:
    json_path, png_path = out / "tiers.json", out / "tiers.png"
    dirs = [arg for d in (directory, *more_dirs) for arg in ("--dir", str(d))]
    done = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "bench", "tiers.py"), "--quick", *dirs,
         "--json", str(json_path), "--png", str(png_path)],
        capture_output=True, text=True, timeout=120, env=child_env(),
    )
    assert done.returncode == 0, done.stderr
    assert "| GB/s |" in done.stdout, done.stdout
    with open(png_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert all(os.listdir(d) == [] for d in (directory, *more_dirs)), "the profiler left files behind"
    with open(json_path) as f:
        records = json.load(f)
    assert isinstance(records, list) and records
    for r in records:
        required = REQUIRED | LAYOUT if r["pair"] == "host-nvme" else REQUIRED
        assert set(required) <= set(r) <= set(required) | {"fio_gbps"}, r
        for key, kind in required.items():
            assert isinstance(r[key], kind), (key, r)
        assert r["block_size"] > 0 and r["queue_depth"] > 0 and r["bytes"] > 0
        assert r["seconds"] > 0 and r["gbps"] > 0
        assert abs(r["gbps"] - r["bytes"] / r["seconds"] / 1e9) < 1e-6 * r["gbps"]
        if "fio_gbps" in r:
            assert isinstance(r["fio_gbps"], float) and r["fio_gbps"] > 0 and r["engine"] != "fio"
    return records, done.stderr


def libaio_loads() -> bool:
    try:
        load_aio()
    except EngineUnavailableError:
        return False
    return True


def test_quick_run_on_disk(tmp_path):
    directory = tmp_path / "nvme"
    directory.mkdir()
    records, _ = run_quick(directory, tmp_path)
    engines = {r["engine"] for r in records if r["pair"] == "host-nvme"}
    assert {"threads", "aiofiles"} <= engines
    assert ("libaio" in engines) == libaio_loads()
    assert {r["direction"] for r in records if r["pair"] == "host-nvme"} == {"read", "write"}
    assert len({(r["block_size"], r["queue_depth"], r["bytes"]) for r in records}) >= 2
    if shutil.which("fio"):
        assert "fio" in engines
        ours = [r for r in records if r["pair"] == "host-nvme" and r["engine"] != "fio"]
        assert all("fio_gbps" in r for r in ours)
    else:
        assert not any("fio_gbps" in r for r in records)


def test_quick_run_without_o_direct_falls_back_and_says_so(ramfs_dir, tmp_path):
    """ramfs refuses O_DIRECT: libaio, aiofiles and fio are skipped with a reason, threads runs buffered."""
    records, notes = run_quick(ramfs_dir, tmp_path)
    assert {r["engine"] for r in records} == {"threads"}
    assert "threads requested (buffered" in notes
    assert "libaio skipped" in notes and "aiofiles skipped" in notes
    if shutil.which("fio"):
        assert "fio skipped" in notes


def test_quick_run_striped_over_two_directories(tmp_path):
    """Our store over both directories, one segment per directory; fio and aiofiles on the first alone."""
    first, second = tmp_path / "nvme0", tmp_path / "nvme1"
    first.mkdir()
    second.mkdir()
    records, notes = run_quick(first, tmp_path, second)
    assert f"NVMe files in {first}, {second} (2 segments per transfer" in notes
    for r in records:
        if r["pair"] == "host-nvme":
            striped = r["engine"] in ("libaio", "threads")
            assert (r["dirs"], r["segments"]) == ((2, 2) if striped else (1, 1)), r
    assert {"threads", "aiofiles"} <= {r["engine"] for r in records}
