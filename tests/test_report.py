"""`python -m zero.report`: the checks name what this machine has (libaio, O_DIRECT, the CPU-Adam loop), say
what follows on a RAM filesystem, measure bandwidth into a figures file the planner can load, and turn bad
input into errors that name the argument and the value."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

from conftest import child_env
from zero.optim.adam_math import kernel_choice
from zero.report import DiskFigures, load_figures, measure
from zero.report import bandwidth
from zero.report.__main__ import main
from zero.report.checks import filesystem

SCHEMA = {"nvme_path": str, "read_gbps": float, "write_gbps": float, "mixed_gbps": float, "engine": str,
          "measured_at": str, "bytes": int}


def report(capsys, *argv) -> tuple[int, dict[str, dict]]:
    """Exit status and the checks by name, from --json."""
    status = main([*argv, "--json"])
    out = json.loads(capsys.readouterr().out)
    return status, {c["name"]: c for c in out["checks"]}


def test_disk_path(tmp_path, capsys):
    status, checks = report(capsys, "--nvme-path", str(tmp_path), "--save", str(tmp_path / "none.json"))
    assert status == 0
    assert checks["libaio"]["verdict"] == "OK" and "available" in checks["libaio"]["found"]
    assert checks["cpu-adam"]["found"] == kernel_choice()
    assert checks["figures"]["verdict"] == "WARN" and "--bandwidth" in checks["figures"]["fix"]
    assert os.listdir(tmp_path) == []  # the store the checks opened removed its file
    fstype, _ = filesystem(str(tmp_path))
    if fstype not in ("ext4", "xfs"):
        pytest.skip(f"tmp_path is on {fstype}, not ext4/xfs: O_DIRECT may rightly be unavailable there")
    assert checks["O_DIRECT"]["verdict"] == "OK" and checks["filesystem"]["found"].startswith(fstype)
    assert checks["engine"]["found"].startswith("libaio")


def test_each_directory_of_a_striped_nvme_path_is_checked(tmp_path, capsys):
    first, second = tmp_path / "nvme0", tmp_path / "nvme1"
    first.mkdir()
    second.mkdir()
    status = main(["--nvme-path", str(first), str(second), "--save", str(tmp_path / "none.json"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert status == 0 and out["nvme_path"] == [str(first), str(second)]
    paths = [c["found"] for c in out["checks"] if c["name"] == "nvme path"]
    assert [p.split(":")[0] for p in paths] == [str(first), str(second)]
    assert sum(c["name"] == "O_DIRECT" for c in out["checks"]) == 2
    (stripes,) = [c for c in out["checks"] if c["name"] == "stripes"]
    assert stripes["verdict"] == "WARN" and "share one device" in stripes["found"]  # both on tmp_path's disk
    assert os.listdir(first) == os.listdir(second) == []


def test_tmpfs_path(capsys):
    if not os.path.isdir("/dev/shm") or filesystem("/dev/shm")[0] != "tmpfs":
        pytest.skip("/dev/shm is absent or not a tmpfs here")
    _, checks = report(capsys, "--nvme-path", "/dev/shm", "--save", "/dev/shm/zt-report-none.json")
    assert checks["filesystem"]["verdict"] == "WARN" and "counts against RAM" in checks["filesystem"]["found"]
    path = f"/dev/shm/zt-report-probe-{os.getpid()}"
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        kernel_takes_direct = True  # Linux >= 6.6 tmpfs accepts O_DIRECT (its pages are still RAM)
    except OSError as exc:
        assert exc.errno == errno.EINVAL
        kernel_takes_direct = False
    finally:
        if os.path.exists(path):
            os.unlink(path)
    found = checks["O_DIRECT"]["found"]
    if kernel_takes_direct:
        assert checks["O_DIRECT"]["verdict"] == "OK" and "its pages are RAM" in found
    else:
        assert "unavailable" in found and "falls back to `threads`, buffered" in found and "RAM" in found


def test_no_direct_io_names_the_fallback(ramfs_dir, capsys):
    """ramfs refuses O_DIRECT on every kernel: the fallback a pre-6.6 tmpfs gets."""
    _, checks = report(capsys, "--nvme-path", ramfs_dir, "--save", os.path.join(ramfs_dir, "none.json"))
    found = checks["O_DIRECT"]["found"]
    assert checks["O_DIRECT"]["verdict"] == "WARN"
    assert "unavailable" in found and "`auto` engine falls back to `threads`, buffered (page cache)" in found
    assert "ramfs is RAM" in found
    assert checks["engine"]["verdict"] == "WARN" and "using threads, buffered" in checks["engine"]["found"]


def test_bandwidth_saves_figures_that_load(tmp_path, capsys):
    data, file = tmp_path / "data", tmp_path / "cache" / "zero_tiering" / "machine.json"
    data.mkdir()
    status, checks = report(capsys, "--bandwidth", str(data), "--bandwidth-size", "64MiB", "--save", str(file))
    assert status == 0 and checks["bandwidth"]["verdict"] == "OK"
    saved = json.loads(file.read_text())
    assert {k: type(v) for k, v in saved.items()} == SCHEMA
    assert saved["nvme_path"] == str(data) and saved["bytes"] == 64 << 20
    assert min(saved["read_gbps"], saved["write_gbps"], saved["mixed_gbps"]) > 0
    assert load_figures(file) == DiskFigures(**saved)
    assert os.listdir(data) == [] and os.listdir(file.parent) == ["machine.json"]


def test_measurement_cleans_up_on_error(tmp_path, monkeypatch):
    def fail(jobs, window):
        raise RuntimeError("I/O failed mid-pass")

    monkeypatch.setattr(bandwidth, "_timed", fail)
    with pytest.raises(RuntimeError, match="mid-pass"):
        measure(str(tmp_path), 8 << 20)
    assert os.listdir(tmp_path) == []


def test_missing_nvme_path_fails_by_name():
    """Through `python -m zero.report`: a FAIL line naming the path, a nonzero exit, no traceback."""
    result = subprocess.run([sys.executable, "-m", "zero.report", "--nvme-path", "/nonexistent/zt-nvme"],
                            capture_output=True, text=True, env=child_env(), timeout=60)
    assert result.returncode == 1, result.stderr
    assert "FAIL  nvme path   /nonexistent/zt-nvme does not exist" in result.stdout
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("argv, message", [
    (["--bandwidth", "/nonexistent/zt-nvme"], "argument --bandwidth: '/nonexistent/zt-nvme' does not exist"),
    (["--bandwidth", __file__], f"argument --bandwidth: {__file__!r} is not a directory"),
    (["--save", "/tmp"], "argument --save: '/tmp' is a directory, not a file"),
    (["--bandwidth-size", "lots"], "argument --bandwidth-size: 'lots': expected a size"),
    (["--bandwidth-size", "1000B"], "argument --bandwidth-size: '1000B': a measurement needs at least 1048576"),
])
def test_bad_arguments_name_argument_and_value(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_corrupt_figures_file(tmp_path, capsys):
    file = tmp_path / "machine.json"
    assert load_figures(file) is None
    file.write_text("{not json")
    with pytest.raises(ValueError) as err:
        load_figures(file)
    assert f"disk figures {str(file)!r} are not JSON" in str(err.value)
    good = {"nvme_path": "/x", "read_gbps": 1.5, "write_gbps": 1.0, "mixed_gbps": 2.0, "engine": "libaio (...)",
            "measured_at": "2025-01-01T00:00:00+00:00", "bytes": 1 << 30}
    for bad, key in [({k: v for k, v in good.items() if k != "mixed_gbps"}, "missing key 'mixed_gbps'"),
                     ({**good, "read_gbps": -1.0}, "read_gbps = -1.0"),
                     ({**good, "bytes": "1GiB"}, "bytes = '1GiB'"),
                     ({**good, "measured_at": "yesterday"}, "measured_at = 'yesterday'"),
                     ({**good, "speed": 3}, "unknown key 'speed'")]:
        file.write_text(json.dumps(bad))
        with pytest.raises(ValueError) as err:
            load_figures(file)
        assert str(file) in str(err.value) and key in str(err.value)
    status, checks = report(capsys, "--nvme-path", str(tmp_path), "--save", str(file))
    assert status == 1 and checks["figures"]["verdict"] == "FAIL"
    assert "unknown key 'speed'" in checks["figures"]["found"]
