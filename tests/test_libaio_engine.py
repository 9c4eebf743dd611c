"""The libaio engine (tiering/_aio.c under tiering/engines/libaio_engine.py): its C queue keeps the disk fed while
the caller's thread holds the GIL; a forked child using its parent's queue gets an error, not a hang; every block
comes back once, refused ones too; `auto` picks it on a disk and says why, and without it built takes threads and
says what is missing."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import child_env
from tiering import AioConfig, EngineUnavailableError, NvmeStore, NvmeStoreConfig, aligned_empty

KiB = 1 << 10


def test_libaio_keeps_the_disk_fed_while_another_thread_holds_the_gil(make_store):
    """The libaio engine refills its queue without the GIL: a write of 64 blocks through a queue 2 deep lands
    while this thread never lets the GIL go (a builtin's C loop, as a training thread in Python or launching
    kernels holds it), read back over a second descriptor before the write's handle is even looked at. A reaper
    that needs the GIL to submit the next blocks lands the first 2 at most."""
    store = make_store(engine="libaio", block_size=4 * KiB, queue_depth=2)
    nbytes = 64 * 4 * KiB
    ext = store.allocate(nbytes)
    src = aligned_empty(nbytes)
    src[:nbytes] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    fd = os.open(store.path_of(ext), os.O_RDONLY)
    try:
        handle = store.write(ext, src, nbytes)
        sum(range(90_000_000))  # 1-3 s in C, the GIL held throughout (the disk may be busy with others' I/O)
        landed = os.pread(fd, nbytes, ext.offset)
    finally:
        os.close(fd)
    handle.wait(timeout=30)
    assert landed == bytes(src[:nbytes].numpy())


def test_a_forked_child_reading_its_parents_store_gets_an_error_not_a_hang(make_store):
    """A forked child (a DataLoader worker, say) has neither the queue's reaper thread nor its AIO context: a
    transfer there fails at once naming why, where it would wait forever for a completion nobody reaps."""
    store = make_store(engine="libaio")
    ext = store.allocate(64 * KiB)
    buf = aligned_empty(64 * KiB)
    store.write(ext, buf).wait(timeout=30)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only for the error asked for
        code = 2
        try:
            store.read(ext, buf).wait(timeout=10)
        except OSError as exc:
            code = 0 if "forked child" in str(exc) else 1
        finally:
            os._exit(code)
    assert child_exit(pid) == 0
    store.read(ext, buf).wait(timeout=30)  # the parent's queue is untouched
    from tiering import _aio
    queue = _aio.Queue(4, single_submit=False, overlap_events=True)  # the queue itself, waited on in a child
    pid = os.fork()
    if pid == 0:
        code = 2
        try:
            queue.wait_done()
        except RuntimeError as exc:
            code = 0 if "forked child" in str(exc) else 1
        finally:
            os._exit(code)
    assert child_exit(pid) == 0
    queue.close()


def child_exit(pid: int) -> int:
    """A forked child's exit code; a child still running after 30 s is killed and the test fails (it hung)."""
    for _ in range(300):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung")


def test_without_the_built_queue_auto_takes_threads_and_libaio_says_what_is_missing(tmp_path, monkeypatch):
    """An install without a C compiler has no tiering._aio: `auto` runs on threads and says why; an explicit
    `libaio` is one typed error naming the missing extension."""
    import tiering

    monkeypatch.setitem(sys.modules, "tiering._aio", None)
    monkeypatch.delattr(tiering, "_aio", raising=False)
    store = NvmeStore(NvmeStoreConfig(nvme_path=str(tmp_path), aio=AioConfig(engine="auto")))
    try:
        assert store.engine_name == "threads" and "tiering._aio" in store.engine_reason
    finally:
        store.close()
    with pytest.raises(EngineUnavailableError, match="C extension tiering._aio"):
        NvmeStore(NvmeStoreConfig(nvme_path=str(tmp_path), aio=AioConfig(engine="libaio")))


def test_auto_on_a_disk_picks_libaio_and_says_why(make_store):
    store = make_store(engine="auto")
    assert store.engine_name == "libaio" and store.direct_io
    assert "libaio" in store.engine_reason and "O_DIRECT" in store.engine_reason


def test_the_queue_hands_back_every_completion_once_however_many_wait_uncollected(tmp_path):
    """Completions wait in the C queue until collected: 600 blocks submitted in uneven batches through a queue 4
    deep with nothing collecting (the list they wait in grows while the reaper records them) all come back, each
    token once with its byte count, and the data is on disk."""
    from tiering import _aio
    path = tmp_path / "blocks"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    src = aligned_empty(4 * KiB)
    src[:4 * KiB] = 7
    queue = _aio.Queue(4, single_submit=False, overlap_events=True)
    try:
        tokens = iter(range(600))
        for size in (1, 63, 200, 336):
            batch = [next(tokens) for _ in range(size)]
            queue.submit([(t, 1, fd, src.data_ptr(), 4 * KiB, 4 * KiB * t) for t in batch])
        done = {}
        while len(done) < 600:
            for token, result in queue.wait_done():
                assert token not in done
                done[token] = result
    finally:
        queue.close()
        os.close(fd)
    assert done == {t: 4 * KiB for t in range(600)}
    assert path.read_bytes() == bytes([7]) * (600 * 4 * KiB)


REFUSED = """
from tiering import _aio
queue = _aio.Queue(4, single_submit=False, overlap_events=True)
queue.submit([(t, 0, -1, 4096, 4096, 4096 * t) for t in range(10)])  # fd -1: io_submit refuses each (EBADF)
done = {}
while len(done) < 10:
    done.update(queue.wait_done())
queue.close()
print(sorted(done.items()))
"""


def test_blocks_the_kernel_refuses_each_complete_with_its_error_and_close_returns():
    """io_submit refusing every block of a queue with nothing in flight (a bad descriptor): each fails at once with
    -EBADF and the blocks beyond the queue's depth take the freed slots, so all ten come back and close returns (in
    a child process: a block left pending, with no completion to pump it, would hang it)."""
    done = subprocess.run([sys.executable, "-c", REFUSED], capture_output=True, text=True, timeout=120,
                          env=child_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str([(t, -errno.EBADF) for t in range(10)])


EMPTIED = """
from tiering import _aio
blocks = []
class Token:
    def __init__(self, t):
        self.t = t
    def __index__(self):
        blocks.clear()  # the caller's list emptied (its blocks freed) while the queue reads it
        return self.t
blocks.extend((Token(t), 0, -1, 4096, 4096, 4096 * t) for t in range(10))
queue = _aio.Queue(4, single_submit=False, overlap_events=True)
queue.submit(blocks)
done = {}
while len(done) < 10:
    done.update(queue.wait_done())
queue.close()
print(sorted(done.items()))
"""


def test_a_list_of_blocks_changed_while_submit_reads_it_is_submitted_as_it_was_given():
    """submit reads a snapshot of the list: an item's conversion (Python code) emptying the list neither frees
    the blocks under it nor shortens what it reads (in a child process: a crash fails the test, not the run)."""
    done = subprocess.run([sys.executable, "-c", EMPTIED], capture_output=True, text=True, timeout=120,
                          env=child_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str([(t, -errno.EBADF) for t in range(10)])
