"""NvmeStore through every engine, on real filesystems.

- Round trips (hypothesis): any tensor, of every dtype torch can copy, staged through an aligned host buffer,
  written, read back into a poisoned buffer, byte-identical, and the bytes are in the file itself.
- Many requests in flight: small block_size and queue_depth so transfers span blocks and the queue fills.
- The libaio engine's own behaviour (its C queue, the engine `auto` picks): test_libaio_engine.py.
- A store's life and its settings' errors: test_nvme_store_life.py.
- Bad input: missing / read-only nvme_path, no O_DIRECT (ramfs), out-of-range requests, unaligned buffers, the
  nvme budget, a full disk (RLIMIT_FSIZE in a child process; a small tmpfs): typed errors that name the path
  and the offset / bytes, and no failed write is ever reported done.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import ENGINES, child_env, mounted
from tiering import (
    ALIGNMENT,
    AioConfig,
    AlignmentError,
    BudgetExceededError,
    DirectIOUnsupportedError,
    Extent,
    HostBufferPool,
    HostPoolConfig,
    NvmePathError,
    NvmeStore,
    NvmeStoreConfig,
    StoreFullError,
    StoreRangeError,
    aligned_empty,
    gather,
)
from tiering.errors import fmt_bytes

KiB, MiB = 1 << 10, 1 << 20
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


# ---------------------------------------------------------------------------------------------------------
# Tensors of every dtype


def _round_trippable_dtypes() -> list[torch.dtype]:
    """Every dtype torch has whose tensors can be created and copied (quantized dtypes need a quantizer;
    the sub-byte int1..int7 / uint1..uint7 placeholders have no copy kernel)."""
    found: dict[str, torch.dtype] = {}
    for name in sorted(dir(torch)):
        dtype = getattr(torch, name)
        if not isinstance(dtype, torch.dtype) or name.startswith(("qint", "quint")) or dtype in found.values():
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # complex32: "ComplexHalf support is experimental"
                torch.empty((2, 3), dtype=dtype).T.contiguous()
        except (RuntimeError, NotImplementedError, TypeError):
            continue
        found[name] = dtype
    return list(found.values())


DTYPES = _round_trippable_dtypes()
REQUIRED_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.complex64, torch.complex128,
] + [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                 "uint16", "uint32", "uint64", "complex32") if hasattr(torch, n)]


def test_every_required_dtype_is_covered():
    missing = [d for d in REQUIRED_DTYPES if d not in DTYPES]
    assert not missing, f"round trips do not cover {missing}"


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int, transposed: bool) -> torch.Tensor:
    """A tensor with arbitrary bit patterns (NaNs, subnormals, ...), non-contiguous if `transposed`."""
    numel = 1
    for dim in shape:
        numel *= dim
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    if transposed and len(shape) >= 2:
        swapped = shape[:-2] + (shape[-1], shape[-2])
        return raw.view(dtype).view(swapped).transpose(-1, -2)
    return raw.view(dtype).view(shape)


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` in row-major order, as a flat uint8 tensor."""
    return t.contiguous().reshape(-1).view(torch.uint8)


@st.composite
def tensors(draw, max_bytes: int = 160 * KiB) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    limit = max_bytes // dtype.itemsize
    shape = draw(st.one_of(
        st.lists(st.integers(0, 40), max_size=3).map(tuple),
        st.integers(0, limit).map(lambda n: (n,)),
        st.sampled_from([(), (0,), (0, 7), (1,), (4097,), (ALIGNMENT // dtype.itemsize,)]),
    ))
    numel = 1
    for dim in shape:
        numel *= dim
    if numel > limit:
        shape = (limit,)
    return make_tensor(dtype, shape, draw(st.integers(0, 2**31)), draw(st.booleans()))


# ---------------------------------------------------------------------------------------------------------
# Round trips


class Staged:
    """One tensor on its way through the store: its extent and its aligned host buffer."""

    def __init__(self, store: NvmeStore, pool: HostBufferPool, tensor: torch.Tensor):
        self.store, self.pool, self.tensor = store, pool, tensor
        self.expected = tensor_bytes(tensor)
        self.nbytes = self.expected.numel()
        self.extent = store.allocate(self.nbytes)

    def write(self):
        self.out = self.pool.acquire(self.nbytes, "write")
        self.out.tensor.copy_(self.expected)  # stage in: tensor bytes -> aligned buffer
        return self.store.write(self.extent, self.out.storage, self.nbytes)

    def read(self):
        self.inp = self.pool.acquire(self.nbytes, "read")
        # Poison: every byte the read does not deliver differs from the expected one.
        self.inp.tensor.copy_(torch.bitwise_not(self.expected))
        return self.store.read(self.extent, self.inp.storage, self.nbytes)

    def check(self, file_fd: int):
        back = self.inp.view(self.tensor.dtype, self.tensor.shape)  # stage out: buffer -> typed tensor
        assert back.dtype == self.tensor.dtype and back.shape == self.tensor.shape
        assert torch.equal(tensor_bytes(back.clone()), self.expected), (
            f"{self.tensor.dtype}{tuple(self.tensor.shape)} at {self.extent} differs after the round trip"
        )
        on_disk = os.pread(file_fd, self.nbytes, self.extent.offset)
        assert on_disk == self.expected.numpy().tobytes(), f"bytes at {self.extent} never reached the file"

    def done(self):
        for buf in (getattr(self, "out", None), getattr(self, "inp", None)):
            if buf is not None and buf.storage is not None:
                buf.release()
        self.store.free(self.extent)


def round_trip(store: NvmeStore, pool: HostBufferPool, tensors_: list[torch.Tensor], file_fd: int) -> None:
    """Write all, wait on all, read all, wait on all: everything in flight at once."""
    staged = [Staged(store, pool, t) for t in tensors_]
    try:
        writes = [s.write() for s in staged]
        gather(writes).wait(timeout=60)
        assert all(h.done() and h.error is None for h in writes)
        reads = [s.read() for s in staged]
        gather(reads).wait(timeout=60)
        assert all(h.done() and h.error is None for h in reads)
        for s in staged:
            s.check(file_fd)
    finally:
        for s in staged:
            s.done()


# Engine settings that make a transfer span several blocks and fill the queue; libaio's submission modes.
ROUND_TRIP_CONFIGS = {
    "libaio-bs4k-qd1": dict(engine="libaio", block_size=4 * KiB, queue_depth=1),
    "libaio-bs8k-qd4-single": dict(engine="libaio", block_size=8 * KiB, queue_depth=4, single_submit=True),
    "libaio-bs12k-qd3-batch": dict(engine="libaio", block_size=12 * KiB, queue_depth=3, overlap_events=False),
    "libaio-default": dict(engine="libaio"),
    "threads-bs4k-2": dict(engine="threads", block_size=4 * KiB, intra_op_parallelism=2),
    "threads-default": dict(engine="threads"),
}


@pytest.fixture(scope="module")
def host_pool():
    return HostBufferPool(HostPoolConfig(budget=256 * MiB, pin=False))


@pytest.fixture(scope="module", params=list(ROUND_TRIP_CONFIGS), ids=list(ROUND_TRIP_CONFIGS))
def rt_store(request, tmp_path_factory):
    """(store, fd of the same file opened plainly, for checking what is on disk)."""
    directory = tmp_path_factory.mktemp("rt")
    store = NvmeStore(NvmeStoreConfig(nvme_path=str(directory), grow_step=1 * MiB,
                                      aio=AioConfig(**ROUND_TRIP_CONFIGS[request.param])))
    assert store.engine_name == ROUND_TRIP_CONFIGS[request.param]["engine"] and store.direct_io
    fd = os.open(store.path, os.O_RDONLY)
    yield store, fd
    os.close(fd)
    store.close()
    assert not os.listdir(directory)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=tensors())
@example(t=torch.empty(0, dtype=torch.bfloat16))
@example(t=torch.empty((0, 3), dtype=torch.complex128))
@example(t=make_tensor(torch.bfloat16, (4097,), 1, False))  # 8194 bytes: not a multiple of 4 KiB
@example(t=make_tensor(torch.bool, (3, 5), 2, True))
@example(t=make_tensor(torch.float64, (), 3, False))
def test_round_trip_is_byte_identical(rt_store, host_pool, t):
    store, fd = rt_store
    round_trip(store, host_pool, [t], fd)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ts=st.lists(tensors(max_bytes=64 * KiB), min_size=8, max_size=40))
def test_many_requests_in_flight(rt_store, host_pool, ts):
    store, fd = rt_store
    round_trip(store, host_pool, ts, fd)
    assert store.used_bytes == 0


def test_one_transfer_of_many_blocks(make_store, engine):
    store = make_store(engine=engine, block_size=64 * KiB, queue_depth=4, intra_op_parallelism=3)
    nbytes = 3 * MiB + 123
    ext = store.allocate(nbytes)
    src = aligned_empty(nbytes)
    src[:nbytes] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = aligned_empty(nbytes)
    store.write(ext, src, nbytes).wait(timeout=30)
    h = store.read(ext, dst, nbytes)
    h.wait(timeout=30)
    assert torch.equal(dst[:nbytes], src[:nbytes])


def test_writers_on_many_threads_at_once(make_store, engine):
    """submit() is called from several threads while the engine completes earlier requests."""
    store = make_store(engine=engine, block_size=4 * KiB, queue_depth=2, intra_op_parallelism=2)
    failures: list[BaseException] = []

    def worker(seed: int):
        try:
            g = torch.Generator().manual_seed(seed)
            for _ in range(15):
                n = int(torch.randint(1, 40 * KiB, (1,), generator=g))
                ext = store.allocate(n)
                src, dst = aligned_empty(n), aligned_empty(n)
                src[:n] = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
                dst.fill_(0)
                store.write(ext, src, n).wait(timeout=30)
                store.read(ext, dst, n).wait(timeout=30)
                assert torch.equal(src[:n], dst[:n]), f"thread {seed}: {ext} corrupted"
                store.free(ext)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures[0]


def test_zero_byte_transfer_is_done_at_once(make_store, engine):
    store = make_store(engine=engine)
    ext = store.allocate(0)
    assert ext.length == ALIGNMENT
    h = store.write(ext, aligned_empty(0), 0)
    assert h.done()
    h.wait(timeout=0)


def test_close_waits_for_everything_in_flight(tmp_path, engine):
    store = NvmeStore(NvmeStoreConfig(nvme_path=str(tmp_path), grow_step=1 * MiB,
                                      aio=AioConfig(engine=engine, block_size=4 * KiB, queue_depth=2)))
    buf = aligned_empty(1 * MiB)
    handles = [store.write(store.allocate(1 * MiB), buf) for _ in range(8)]
    store.close()
    assert all(h.done() for h in handles)
    for h in handles:
        h.wait(timeout=0)
    assert not os.listdir(tmp_path)


def test_store_grows_by_its_size_up_to_grow_step_and_reuses_freed_space(make_store):
    """The file starts at the first request's size and grows by its own size (doubling), at most grow_step at a
    time, or by what a request needs where that is more: a small state gets a small file."""
    store = make_store(grow_step=256 * KiB)
    a = store.allocate(100 * KiB)
    assert store.capacity == 100 * KiB == os.path.getsize(store.path)
    store.allocate(4 * KiB)  # grows by its size: doubles
    assert store.capacity == 200 * KiB == os.path.getsize(store.path)
    store.allocate(100 * KiB)  # 96 KiB free at the end: grows by its size, 200 KiB
    assert store.capacity == 400 * KiB == os.path.getsize(store.path)
    store.allocate(200 * KiB)  # 196 KiB free at the end: by its size, capped at grow_step
    assert store.capacity == 400 * KiB + 256 * KiB == os.path.getsize(store.path)
    b = store.allocate(600 * KiB)  # 252 KiB free at the end: 348 KiB needed, more than grow_step
    assert store.capacity == os.path.getsize(store.path) == 1004 * KiB
    grown = store.capacity
    store.free(a)
    c = store.allocate(90 * KiB)
    assert c.offset == a.offset and store.capacity == grown
    assert store.used_bytes == c.length + b.length + (4 + 100 + 200) * KiB
    store.sync()


# ---------------------------------------------------------------------------------------------------------
# Bad input


def test_missing_nvme_path(tmp_path, engine):
    missing = tmp_path / "no" / "such"
    with pytest.raises(NvmePathError) as info:
        NvmeStore(NvmeStoreConfig(nvme_path=str(missing), aio=AioConfig(engine=engine)))
    assert info.value.path == str(missing) and str(missing) in str(info.value)
    assert "does not exist" in str(info.value)
    assert isinstance(info.value, OSError)


def test_create_makes_a_missing_nvme_path_as_deepspeed_does(tmp_path, readonly_dir):
    """zero's configs open the store with create=True (DeepSpeed creates its swap folder under nvme_path); where the
    directory cannot be made, the error says so and why."""
    missing = tmp_path / "no" / "such"
    with NvmeStore(NvmeStoreConfig(nvme_path=str(missing), create=True)) as store:
        assert os.path.dirname(store.path) == str(missing)
    assert os.listdir(missing) == []
    unmakeable = os.path.join(readonly_dir, "swap")
    with pytest.raises(NvmePathError, match="does not exist and cannot be created .Read-only file system.") as info:
        NvmeStore(NvmeStoreConfig(nvme_path=unmakeable, create=True))
    assert info.value.path == unmakeable


def test_nvme_path_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(NvmePathError, match="not a directory") as info:
        NvmeStore(NvmeStoreConfig(nvme_path=str(f)))
    assert str(f) in str(info.value)


def test_read_only_nvme_path(readonly_dir, engine):
    with pytest.raises(NvmePathError) as info:
        NvmeStore(NvmeStoreConfig(nvme_path=readonly_dir, aio=AioConfig(engine=engine)))
    assert info.value.path == readonly_dir and readonly_dir in str(info.value)
    assert "writable" in str(info.value)
    assert os.listdir(readonly_dir) == []


def test_no_o_direct_libaio_refuses_naming_the_path(ramfs_dir):
    with pytest.raises(DirectIOUnsupportedError) as info:
        NvmeStore(NvmeStoreConfig(nvme_path=ramfs_dir, aio=AioConfig(engine="libaio")))
    err = info.value
    assert err.path.startswith(ramfs_dir + os.sep) and err.path in str(err)
    assert err.engine == "libaio" and "O_DIRECT" in str(err)
    assert os.listdir(ramfs_dir) == [], "the refused store must remove the file it created"


@pytest.mark.parametrize("engine_", ["auto", "threads"])
def test_no_o_direct_falls_back_to_buffered_threads(ramfs_dir, host_pool, engine_):
    store = NvmeStore(NvmeStoreConfig(nvme_path=ramfs_dir, grow_step=256 * KiB,
                                      aio=AioConfig(engine=engine_, block_size=8 * KiB)))
    try:
        assert store.engine_name == "threads" and not store.direct_io
        reason = store.engine_reason
        assert "threads" in reason and "O_DIRECT" in reason
        if engine_ == "auto":
            assert "auto" in reason and "buffered" in reason and ramfs_dir in reason
        fd = os.open(store.path, os.O_RDONLY)
        try:
            ts = [make_tensor(d, (1000 + 37 * i,), i, False) for i, d in enumerate(DTYPES)]
            round_trip(store, host_pool, ts, fd)
        finally:
            os.close(fd)
    finally:
        store.close()
    assert os.listdir(ramfs_dir) == []


def test_requests_beyond_the_extent_or_store(make_store, engine):
    store = make_store(engine=engine, grow_step=64 * KiB)
    ext = store.allocate(8 * KiB)
    buf = aligned_empty(128 * KiB)
    cases = [
        (Extent(store.capacity, 4096), None, store.capacity, 4096, "past the end of the store"),
        (Extent(60 * KiB, 8 * KiB), None, 60 * KiB, 8 * KiB, "past the end of the store"),
        (ext, 8 * KiB + 1, ext.offset, 8 * KiB + 1, "past its extent"),
        (ext, -1, ext.offset, -1, "past its extent"),
        (Extent(-4096, 4096), None, -4096, 4096, "negative"),
        (Extent(100, 4096), None, 100, 4096, "unaligned"),
        (Extent(0, 100), 100, 0, 100, "unaligned"),
    ]
    for op in (store.read, store.write):
        for extent, nbytes, offset, size, words in cases:
            with pytest.raises(StoreRangeError, match=words) as info:
                op(extent, buf, nbytes)
            err = info.value
            assert (err.path, err.offset, err.nbytes) == (store.path, offset, size)
            message = str(err)
            assert store.path in message and f"offset {offset}" in message and f"{size} bytes" in message
            assert isinstance(err, IndexError)


def test_unaligned_or_small_buffers(make_store, engine):
    store = make_store(engine=engine)
    ext = store.allocate(8 * KiB)
    base = aligned_empty(16 * KiB)
    bad = {
        "not 4096-byte aligned": base[1 : 1 + 8 * KiB],
        "holds 4096 bytes": base[: 4 * KiB],
        "contiguous": base.view(2, 8 * KiB).t(),
        "holds 4097": base[: 4097],  # 4097 bytes asked of the buffer below: 8 KiB needed
    }
    for words, buffer in bad.items():
        nbytes = 4097 if words == "holds 4097" else 8 * KiB
        for op in (store.read, store.write):
            with pytest.raises(AlignmentError) as info:
                op(ext, buffer, nbytes)
            message = str(info.value)
            assert store.path in message and f"offset {ext.offset}" in message and f"{nbytes} bytes" in message
            if words != "holds 4097":
                assert words in message
    assert isinstance(info.value, ValueError)
    store.write(ext, base, 8 * KiB).wait(timeout=10)  # the store is fine after refusing


def test_nvme_budget_is_hard(make_store, engine):
    store = make_store(engine=engine, budget=1 * MiB, grow_step=384 * KiB)
    a = store.allocate(700 * KiB)
    b = store.allocate(300 * KiB)
    assert store.capacity <= 1 * MiB
    before = (store.capacity, store.used_bytes, os.path.getsize(store.path))
    with pytest.raises(BudgetExceededError) as info:
        store.allocate(64 * KiB, "layers.3/adam")
    err = info.value
    assert (err.tier, err.budget, err.in_use, err.requested) == ("nvme", MiB, a.length + b.length, 64 * KiB)
    assert err.path == store.path and err.what == "layers.3/adam"
    message = str(err)
    for text in ("nvme", fmt_bytes(MiB), fmt_bytes(a.length + b.length), fmt_bytes(64 * KiB), "layers.3/adam",
                 store.path):
        assert text in message
    assert (store.capacity, store.used_bytes, os.path.getsize(store.path)) == before
    store.free(b)
    c = store.allocate(300 * KiB)
    buf = aligned_empty(c.length).fill_(3)
    store.write(c, buf).wait(timeout=10)


def test_small_tmpfs_fills_up(small_tmpfs_dir, engine, host_pool):
    try:
        store = NvmeStore(NvmeStoreConfig(nvme_path=small_tmpfs_dir, grow_step=128 * KiB,
                                          aio=AioConfig(engine=engine, block_size=32 * KiB)))
    except DirectIOUnsupportedError:
        pytest.skip("this kernel's tmpfs has no O_DIRECT")
    fd = os.open(store.path, os.O_RDONLY)
    try:
        kept = [Staged(store, host_pool, make_tensor(torch.float32, (32 * KiB,), 7, False))]  # 128 KiB
        gather([s.write() for s in kept]).wait(timeout=10)
        extents = []
        with pytest.raises(StoreFullError) as info:
            for _ in range(64):
                extents.append(store.allocate(128 * KiB, "filler"))
        err = info.value
        assert err.errno == errno.ENOSPC and err.path == store.path
        assert store.path in str(err) and fmt_bytes(err.requested) in str(err) and err.requested > 0
        assert err.size == store.capacity == os.path.getsize(store.path), "a failed grow must leave the file as it was"
        # Still usable for what it already had.
        gather([s.read() for s in kept]).wait(timeout=10)
        for s in kept:
            s.check(fd)
        store.free(extents.pop())
        reused = store.allocate(128 * KiB)
        buf = aligned_empty(reused.length).fill_(9)
        store.write(reused, buf).wait(timeout=10)
        for s in kept:
            s.done()
    finally:
        os.close(fd)
        store.close()
    assert os.listdir(small_tmpfs_dir) == []


FULL_DISK_CHILD = r"""
import errno, json, os, resource, signal, sys, torch
from tiering import AioConfig, IOFailedError, NvmeStore, NvmeStoreConfig, StoreFullError, aligned_empty
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the syscall then fails with EFBIG instead of killing us
directory, engines = sys.argv[1], sys.argv[2:]
KiB, MiB = 1 << 10, 1 << 20
LIMIT = 1 * MiB
HARD = resource.getrlimit(resource.RLIMIT_FSIZE)[1]


def scenario(engine):
    out = {}
    store = NvmeStore(NvmeStoreConfig(nvme_path=directory, grow_step=256 * KiB,
                                      aio=AioConfig(engine=engine, block_size=64 * KiB, queue_depth=4)))
    out["path"], out["engine"] = store.path, store.engine_name
    a = store.allocate(512 * KiB)                 # [0, 512K)
    b = store.allocate(1 * MiB)                   # [512K, 1.5M): half of it past the limit set below
    old_a, old_b = aligned_empty(a.length).fill_(0xAA), aligned_empty(b.length).fill_(0xBB)
    store.write(a, old_a).wait(); store.write(b, old_b).wait()
    capacity = store.capacity
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, HARD))  # the file may no longer reach past 1 MiB

    try:                                           # 1. the store cannot grow
        store.allocate(1 * MiB, "grow")
        out["grow"] = None
    except StoreFullError as exc:
        out["grow"] = {"errno": exc.errno, "path": exc.path, "requested": exc.requested, "size": exc.size,
                       "message": str(exc)}
    out["capacity_unchanged"] = store.capacity == capacity == os.path.getsize(store.path)

    new_b = aligned_empty(b.length).fill_(0x5C)   # 2. a write whose tail cannot reach the file
    h = store.write(b, new_b)
    try:
        h.wait(timeout=60)
        out["write"] = None
    except IOFailedError as exc:
        out["write"] = {"errno": exc.errno, "path": exc.path, "op": exc.op, "offset": exc.offset,
                        "nbytes": exc.nbytes, "message": str(exc), "done": h.done(),
                        "error_is_kept": h.error is exc}

    back = aligned_empty(b.length)                # the part past the limit still holds the old bytes
    store.read(b, back).wait()
    split = LIMIT - b.offset
    out["below_limit_new"] = bool((back[:split] == 0x5C).all())
    out["past_limit_old"] = bool((back[split:] == 0xBB).all())

    back_a = aligned_empty(a.length)              # 3. what it already had is intact and still writable
    store.read(a, back_a).wait()
    out["a_intact"] = bool(torch.equal(back_a, old_a))
    store.write(a, aligned_empty(a.length).fill_(0x01)).wait()
    store.read(a, back_a).wait()
    out["a_rewritten"] = bool((back_a == 0x01).all())
    store.close()
    out["removed"] = not os.path.exists(out["path"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (HARD, HARD))
    return out


print(json.dumps({engine: scenario(engine) for engine in engines}))
"""


@pytest.fixture(params=["disk", "ramfs"])
def full_disk_target(request, tmp_path):
    """(directory, engines to run there): a disk with O_DIRECT, and ramfs (buffered writes fail alike)."""
    if request.param == "disk":
        yield str(tmp_path), ENGINES
    else:
        with mounted("ramfs") as directory:
            yield directory, ["auto"]


def test_full_disk_via_rlimit_fsize(full_disk_target):
    directory, engines = full_disk_target
    proc = subprocess.run([sys.executable, "-c", FULL_DISK_CHILD, directory, *engines],
                          capture_output=True, text=True, timeout=120, env=child_env())
    assert proc.returncode == 0, f"child failed (killed by SIGXFSZ?): rc {proc.returncode}\n{proc.stderr}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(results) == sorted(engines)
    for engine, out in results.items():
        check_full_disk(engine, out)


def check_full_disk(engine: str, out: dict) -> None:
    path = out["path"]
    if engine != "auto":
        assert out["engine"] == engine

    grow = out["grow"]
    assert grow is not None, f"{engine}: growing past RLIMIT_FSIZE did not raise StoreFullError"
    assert grow["errno"] == errno.EFBIG and grow["path"] == path
    assert path in grow["message"] and fmt_bytes(grow["requested"]) in grow["message"]
    assert fmt_bytes(grow["size"]) in grow["message"]
    assert out["capacity_unchanged"], f"{engine}: a failed grow changed the store or its file"

    write = out["write"]
    assert write is not None, f"{engine}: a write that could not reach the file was reported done"
    assert write["errno"] == errno.EFBIG and write["path"] == path and write["op"] == "write"
    assert write["offset"] >= 1 * MiB and write["nbytes"] > 0
    assert path in write["message"] and f"offset {write['offset']}" in write["message"]
    assert f"{write['nbytes']} bytes" in write["message"]
    assert write["done"] and write["error_is_kept"]
    assert out["below_limit_new"] and out["past_limit_old"], f"{engine}: wrong bytes around the limit"
    assert out["a_intact"] and out["a_rewritten"], f"{engine}: the store lost or refused what it had"
    assert out["removed"]
