"""A disk too small for the state homed on nvme is one error before any byte is written: naming the directory
(or the nvme budget), the bytes needed and the bytes free; the command line prints it as one line and exits
non-zero. The check follows the store's own placement of whole segments in the least-used file."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import zero
from tiering import NvmeSpaceError, NvmeStore, NvmeStoreConfig, check_room
from tiering.nvme_room import bytes_per_file
from zero.services.budgets import nvme_segments
from zero.config import load_config

from conftest import REPO_ROOT, child_env, mounted
from models import one_thread  # noqa: F401  (autouse fixture)
from stage3_models import stage3_config, tiny_gpt2

MiB = 1 << 20


@pytest.fixture
def small_disk():
    """A 64 MiB tmpfs: a real filesystem that fills (root may mount; elsewhere the tests skip)."""
    with mounted("tmpfs", "size=64m") as path:
        yield Path(path)


def test_segments_go_whole_to_the_least_used_file(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    with NvmeStore(NvmeStoreConfig(nvme_path=tuple(map(str, dirs)))) as store:
        assert bytes_per_file(store, [3 * MiB, 1 * MiB, 1 * MiB, 100]) == [3 * MiB, 2 * MiB + 4096]
        store.allocate(5 * MiB)  # what a file holds counts: the next segments go to the other one
        assert bytes_per_file(store, [1 * MiB, 1 * MiB]) == [5 * MiB, 2 * MiB]


@pytest.mark.parametrize("formats", [None, {"moments": "int8", "master": "bf16-kahan"}])
def test_the_engines_own_segments_are_counted(tmp_path, formats):
    """nvme_segments adds up to what the engine's store holds once built (a Kahan master's compensation too)."""
    config = stage3_config("nvme", "nvme", nvme_path=str(tmp_path), bf16=formats is not None,
                           **({} if formats is None else {"zero_tiering": formats}))
    model = tiny_gpt2()
    engine, *_ = zero.initialize(model=model, config=config)
    try:
        cfg = load_config(config)
        units = [unit.flat for unit in engine.placement.units]
        expected = sum(-(-n // 4096) * 4096 for n in nvme_segments(cfg, units, engine.compute_dtype))
        assert engine.swap.store.used_bytes == expected
    finally:
        engine.close()


def test_a_small_disk_is_named_before_any_byte_is_written(small_disk):
    (small_disk / "keep.bin").write_bytes(b"x" * 4096)  # what is already there stays
    config = stage3_config("nvme", "nvme", nvme_path=str(small_disk))
    config["zero_tiering"] = {"host_budget": "256MiB"}
    big = tiny_gpt2(n_embd=512, n_layer=4)  # ~10M parameters: ~150 MiB homed on nvme
    with pytest.raises(NvmeSpaceError, match=rf"nvme_path '{small_disk}': the state homed on nvme needs .* MiB, "
                                              r"more than the 6\d\.\d MiB free there") as caught:
        zero.initialize(model=big, config=config)
    assert caught.value.needed > caught.value.limit
    assert os.listdir(small_disk) == ["keep.bin"], "the store's file outlived the error"


def test_an_nvme_budget_below_the_state_is_named(tmp_path):
    config = stage3_config("nvme", "nvme", nvme_path=str(tmp_path))
    config["zero_tiering"] = {"nvme_budget": "64KiB"}
    with pytest.raises(NvmeSpaceError, match=r"zero_tiering.nvme_budget: .* more than the budget's 64.0 KiB"):
        zero.initialize(model=tiny_gpt2(), config=config)
    assert os.listdir(tmp_path) == []


def test_a_striped_path_names_the_directory_that_is_short(small_disk, tmp_path):
    roomy = tmp_path / "roomy"
    roomy.mkdir()
    with NvmeStore(NvmeStoreConfig(nvme_path=(str(roomy), str(small_disk)))) as store:
        check_room(store, [16 * MiB] * 6)  # 48 MiB each side: fits
        with pytest.raises(NvmeSpaceError, match=f"nvme_path '{small_disk}'"):
            check_room(store, [16 * MiB] * 10)


def test_two_directories_on_one_filesystem_share_its_free_space(small_disk):
    """Two directories of nvme_path on the same 64 MiB tmpfs: 40 MiB fits, but 2 x 40 MiB does not, though each
    directory alone would seem to have room for its half."""
    (small_disk / "a").mkdir()
    (small_disk / "b").mkdir()
    with NvmeStore(NvmeStoreConfig(nvme_path=(str(small_disk / "a"), str(small_disk / "b")))) as store:
        check_room(store, [20 * MiB] * 2)
        with pytest.raises(NvmeSpaceError, match=f"nvme_path '{small_disk / 'a'}', '{small_disk / 'b'}': .* more "
                                                 "than the .* free on the filesystem they share"):
            check_room(store, [20 * MiB] * 4)


def test_the_main_job_on_a_small_disk_is_one_line_and_a_nonzero_exit(small_disk):
    done = subprocess.run([sys.executable, "-m", "zero.train", "--preset", "small", "--steps", "1",
                           "--nvme-path", str(small_disk)],
                          env=child_env(), capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [done.stderr.strip()] and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"zero.train: NvmeSpaceError: [Errno 28] nvme_path '{small_disk}': the state "
                                  "homed on nvme needs")
    assert "step 0" not in done.stdout and os.listdir(small_disk) == []
