"""NvmeStore's life and settings: one file per store, its flock, close removes only that file, two stores
(and two processes) on one nvme_path never clobber each other; config errors name the field."""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ENGINES, child_env
from tiering import (
    AioConfig,
    Extent,
    NvmeStore,
    NvmeStoreConfig,
    TieringConfigError,
    aligned_empty,
    gather,
)

KiB, MiB = 1 << 10, 1 << 20

# ---------------------------------------------------------------------------------------------------------
# Life of a store: its own file, its lock, its neighbours


def test_close_removes_only_its_own_file(tmp_path):
    stranger = tmp_path / "zt-stranger.swap"  # even a name that looks like ours
    stranger.write_bytes(b"not yours")
    other_dir_file = tmp_path / "data.bin"
    other_dir_file.write_bytes(b"x" * 10)
    store = NvmeStore(NvmeStoreConfig(nvme_path=str(tmp_path), grow_step=64 * KiB))
    assert os.path.dirname(store.path) == str(tmp_path)
    name = os.path.basename(store.path)
    assert name.startswith("zt-") and name.endswith(".swap") and str(os.getpid()) in name
    assert sorted(os.listdir(tmp_path)) == sorted(["data.bin", "zt-stranger.swap", name])
    store.allocate(4096)
    store.close()
    store.close()  # idempotent
    assert sorted(os.listdir(tmp_path)) == ["data.bin", "zt-stranger.swap"]
    assert stranger.read_bytes() == b"not yours" and other_dir_file.read_bytes() == b"x" * 10
    with pytest.raises(RuntimeError, match="closed"):
        store.allocate(4096)
    with pytest.raises(RuntimeError, match="closed"):
        store.write(Extent(0, 4096), aligned_empty(4096))


def test_close_does_not_remove_a_file_that_replaced_its_own(tmp_path):
    store = NvmeStore(NvmeStoreConfig(nvme_path=str(tmp_path)))
    os.unlink(store.path)
    with open(store.path, "wb") as f:  # someone else's file under the same name now
        f.write(b"theirs")
    store.close()
    with open(store.path, "rb") as f:
        assert f.read() == b"theirs"


def test_a_script_that_never_closes_leaves_no_swap_file(tmp_path):
    """An engine whose script ends without close() (as DeepSpeed scripts do): its swap file goes at the normal
    end of the process, and it was sized to the state (a small model's file is not a 256 MiB step)."""
    script = """
import sys, torch, zero
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
offload = {"device": "nvme", "nvme_path": sys.argv[1]}
engine, *_ = zero.initialize(model=model, model_parameters=model.parameters(), config={
    "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "offload_param": offload, "offload_optimizer": offload}})
engine.backward(engine(torch.randn(2, 64)).square().mean())
engine.step()
print(engine.swap.store.capacity)
"""
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                          env=child_env(), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    capacity = int(done.stdout.split()[-1])
    state = 2 * (64 * 64 + 64) * (4 + 4 + 4 + 4)  # the fp32 parameters, two moments, the gradient (+ padding)
    assert capacity < 4 * state + (1 << 20), capacity
    assert os.listdir(tmp_path) == []


def test_each_store_holds_an_flock_on_its_file(make_store):
    store = make_store()
    fd = os.open(store.path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_two_stores_in_one_directory_do_not_clobber(tmp_path, engine):
    a = NvmeStore(NvmeStoreConfig(nvme_path=str(tmp_path), grow_step=1 * MiB, aio=AioConfig(engine=engine)))
    b = NvmeStore(NvmeStoreConfig(nvme_path=str(tmp_path), grow_step=1 * MiB, aio=AioConfig(engine=engine)))
    try:
        assert a.path != b.path
        ea, eb = a.allocate(64 * KiB), b.allocate(64 * KiB)
        assert ea == eb  # same offsets, different files
        pa, pb = aligned_empty(64 * KiB).fill_(0xA1), aligned_empty(64 * KiB).fill_(0xB2)
        gather([a.write(ea, pa), b.write(eb, pb)]).wait(timeout=10)
        b.close()
        back = aligned_empty(64 * KiB)
        a.read(ea, back).wait(timeout=10)
        assert torch.equal(back, pa)
        assert os.listdir(tmp_path) == [os.path.basename(a.path)]
    finally:
        a.close()
        b.close()


TWO_PROCESS_CHILD = r"""
import json, os, sys, time, torch
from tiering import AioConfig, NvmeStore, NvmeStoreConfig, aligned_empty, gather
directory, engine, value, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
store = NvmeStore(NvmeStoreConfig(nvme_path=directory, grow_step=1 << 20,
                                  aio=AioConfig(engine=engine, block_size=16384, queue_depth=4)))
print(json.dumps({"path": store.path}), flush=True)
while not os.path.exists(go):
    time.sleep(0.005)
extents = [store.allocate(64 << 10) for _ in range(8)]
bad = 0
for round_ in range(3):
    bufs = [aligned_empty(64 << 10).fill_((value + i + round_) % 256) for i in range(len(extents))]
    gather(store.write(e, b) for e, b in zip(extents, bufs)).wait(timeout=60)
    backs = [aligned_empty(64 << 10) for _ in extents]
    gather(store.read(e, b) for e, b in zip(extents, backs)).wait(timeout=60)
    bad += sum(not torch.equal(b, c) for b, c in zip(bufs, backs))
store.close()
print(json.dumps({"bad": bad, "exists_after_close": os.path.exists(store.path)}), flush=True)
"""


def test_two_processes_on_one_nvme_path_do_not_clobber(tmp_path):
    """Two processes (one per engine) write different patterns to the same offsets at the same time."""
    go = tmp_path / "go"
    directory = tmp_path / "nvme"
    directory.mkdir()
    stranger = directory / "keep.me"
    stranger.write_text("stranger")
    children = [
        subprocess.Popen([sys.executable, "-c", TWO_PROCESS_CHILD, str(directory), engine, str(v), str(go)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
        for engine, v in zip(ENGINES, (0x11, 0x77))
    ]
    try:
        paths = [json.loads(c.stdout.readline())["path"] for c in children]  # both stores are open now
        assert paths[0] != paths[1] and all(os.path.exists(p) for p in paths)
        go.touch()
        results = []
        for c in children:
            out, err = c.communicate(timeout=60)
            assert c.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()
    assert results == [{"bad": 0, "exists_after_close": False}] * 2
    assert os.listdir(directory) == ["keep.me"] and stranger.read_text() == "stranger"


# ---------------------------------------------------------------------------------------------------------
# Config validation names the field


@pytest.mark.parametrize("kwargs, field", [
    (dict(engine="io_uring"), "aio.engine"),
    (dict(block_size=1000), "aio.block_size"),
    (dict(block_size=0), "aio.block_size"),
    (dict(queue_depth=0), "aio.queue_depth"),
    (dict(intra_op_parallelism=2000), "aio.intra_op_parallelism"),
    (dict(single_submit=1), "aio.single_submit"),
    (dict(overlap_events="yes"), "aio.overlap_events"),
])
def test_aio_config_errors_name_the_field(kwargs, field):
    with pytest.raises(TieringConfigError) as info:
        AioConfig(**kwargs)
    assert info.value.field == field and field in str(info.value)


@pytest.mark.parametrize("kwargs, field", [
    (dict(nvme_path=""), "nvme_path"),
    (dict(nvme_path="/tmp", budget=100), "nvme budget"),
    (dict(nvme_path="/tmp", grow_step=1000), "grow_step"),
])
def test_store_config_errors_name_the_field(kwargs, field):
    with pytest.raises(TieringConfigError) as info:
        NvmeStoreConfig(**kwargs)
    assert info.value.field == field
