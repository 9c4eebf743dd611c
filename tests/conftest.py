"""Shared fixtures: I/O engines to parametrize over, stores that are always closed, and real filesystems
mounted for a test (ramfs without O_DIRECT, a read-only tmpfs, a small tmpfs that fills up), always unmounted.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile

import pytest
import torch

from tiering import AioConfig, NvmeStore, NvmeStoreConfig, SwapConfig, SwapManager, TieringError

ENGINES = ["libaio", "threads"]
"""Every I/O engine an explicit config can name; `auto` resolves to one of these."""

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=ENGINES)
def engine(request) -> str:
    return request.param


@pytest.fixture
def make_store(tmp_path):
    """Factory for stores that are closed at teardown; defaults to `tmp_path` (a disk filesystem)."""
    stores: list[NvmeStore] = []

    def make(nvme_path=None, *, engine="threads", budget=None, grow_step=1 << 20, **aio) -> NvmeStore:
        config = NvmeStoreConfig(
            nvme_path=str(nvme_path or tmp_path), budget=budget, grow_step=grow_step,
            aio=AioConfig(engine=engine, **aio),
        )
        store = NvmeStore(config)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


@contextlib.contextmanager
def mounted(fstype: str, options: str | None = None):
    """Mount a fresh `fstype` on a new temporary directory for the duration; skip if this process cannot.

    Unmounts (lazily if busy) and removes the directory whatever happens in the body.
    """
    if os.geteuid() != 0:
        pytest.skip(f"mounting {fstype} needs root (euid {os.geteuid()})")
    directory = tempfile.mkdtemp(prefix=f"zt-{fstype}-")
    argv = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, directory]
    try:
        result = subprocess.run(argv, capture_output=True, text=True)
    except FileNotFoundError:
        os.rmdir(directory)
        pytest.skip("no `mount` binary on this machine")
    if result.returncode != 0:
        os.rmdir(directory)
        pytest.skip(f"`{' '.join(argv)}` not permitted here: {result.stderr.strip() or result.returncode}")
    try:
        yield directory
    finally:
        if subprocess.run(["umount", directory], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", directory], capture_output=True)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def ramfs_dir():
    """A ramfs: no O_DIRECT (open with O_DIRECT fails with EINVAL), no size limit."""
    with mounted("ramfs") as directory:
        yield directory


@pytest.fixture
def readonly_dir():
    """A tmpfs mounted read-only: not writable even by root."""
    with mounted("tmpfs", "ro,size=1m") as directory:
        yield directory


@pytest.fixture
def small_tmpfs_dir():
    """A 1 MiB tmpfs: a real disk that fills up (ENOSPC)."""
    with mounted("tmpfs", "size=1m") as directory:
        yield directory


def readme_block(heading: str) -> str:
    """The first python block under the README's `heading` (a whole heading line, e.g. "### From TRL")."""
    with open(os.path.join(REPO_ROOT, "README.md")) as f:
        section = f.read().split(heading + "\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def child_env() -> dict[str, str]:
    """Environment for a `python -c` child that imports tiering from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


PAGE = 4096
MOVE_TIMEOUT = 20.0
"""Seconds any move may take here (a few pages on a local disk); longer means it will never end."""


@pytest.fixture
def make_manager(tmp_path):
    """Factory for swap managers closed at teardown; `engine` adds an nvme store on tmp_path."""
    managers: list[SwapManager] = []

    def make(*, engine: str | None = None, nvme_budget: int | None = None, **config) -> SwapManager:
        nvme = None
        if engine is not None:
            nvme = NvmeStoreConfig(nvme_path=str(tmp_path), budget=nvme_budget, grow_step=4 * PAGE,
                                   aio=AioConfig(engine=engine))
        config.setdefault("host_budget", 64 * PAGE)
        config.setdefault("prefetch_bytes", 0)
        mgr = SwapManager(SwapConfig(nvme=nvme, **config))
        managers.append(mgr)
        return mgr

    yield make
    for mgr in managers:
        for seg in list(mgr.segments.values()):  # a move that never ends fails the test instead of hanging close()
            if seg.move is not None:
                try:
                    seg.move.wait(MOVE_TIMEOUT)
                except TieringError:
                    pass  # its failure was the test's business
        mgr.close()
