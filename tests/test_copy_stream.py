"""The device tier's copy path (tiering/copy_stream.py, tiering/device_tier.py): copies are asynchronous, run in
submission order, pipeline (submitting never waits for a copy), and report their end through an event and a
Handle; on CPU the copy worker stands in for the GPU's copy stream, so these run in CI. Tests marked `cuda` check
the GPU's side: the copy follows the caller's stream, the device has an index."""
from __future__ import annotations

import threading

import pytest
import torch

from tiering import Handle, SwapConfig, SwapManager
from tiering.copy_stream import WorkerCopyStream
from tiering.device_tier import DeviceTier

WAIT = 20.0
"""Seconds a copy may take here once let through; longer means it never ends."""


class Gate:
    """Holds the copy worker up (the copy engine busy with earlier work) until `open()`; `ran` lists the
    destinations in the order their copies ran."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.ran: list[torch.Tensor] = []

    def run(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert self.opened.wait(WAIT), "the gate was never opened"
        dst.copy_(src)
        self.ran.append(dst)

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def gate(monkeypatch):
    held = Gate()
    monkeypatch.setattr(WorkerCopyStream, "run", staticmethod(held.run))
    yield held
    held.open()  # never leave the worker blocked


def test_copies_are_asynchronous_pipelined_and_complete_in_order(gate):
    tier = DeviceTier(None, torch.device("cpu"))
    try:
        sources = [torch.full((1000,), float(i)) for i in range(3)]
        targets = [torch.zeros(1000) for _ in range(3)]
        order = []
        handles, events = [], []
        for i, (dst, src) in enumerate(zip(targets, sources)):
            handle = Handle(label=f"copy {i}")
            handle.add_done_callback(lambda h, i=i: order.append(i))
            events.append(tier.copy(dst, src, handle))  # returns at once: the worker is held up
            handles.append(handle)
        assert not any(h.done() for h in handles) and not any(e.done() for e in events)
        assert all(not t.any() for t in targets), "a copy landed before the copy engine ran it"
        gate.open()
        for handle in handles:
            handle.wait(WAIT)
        assert all(e.done() for e in events)
        assert order == [0, 1, 2]
        assert [t is d for t, d in zip(gate.ran, targets)] == [True] * 3  # run in submission order
        for dst, src in zip(targets, sources):
            assert torch.equal(dst, src)
    finally:
        tier.close()


def test_the_callers_wait_returns_once_the_bytes_have_landed(gate):
    """`event.wait()` is the compute's wait (on CPU its thread): it returns only after the copy ran."""
    tier = DeviceTier(None, torch.device("cpu"))
    try:
        dst, src = torch.zeros(4096), torch.arange(4096.0)
        event = tier.copy(dst, src)
        waiter = threading.Thread(target=event.wait)
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive(), "the wait returned while the copy was held up"
        gate.open()
        waiter.join(WAIT)
        assert not waiter.is_alive() and torch.equal(dst, src)
    finally:
        tier.close()


def test_a_failed_copy_fails_its_handle_and_event_and_later_copies_run():
    tier = DeviceTier(None, torch.device("cpu"))
    try:
        bad = Handle(label="bad")
        event = tier.copy(torch.zeros(3), torch.zeros(5), bad)
        with pytest.raises(RuntimeError):
            bad.wait(WAIT)
        with pytest.raises(RuntimeError):
            event.wait()
        good = Handle(label="good")
        dst = torch.zeros(5)
        tier.copy(dst, torch.ones(5), good)
        good.wait(WAIT)
        assert torch.equal(dst, torch.ones(5))
    finally:
        tier.close()


def test_a_fetch_to_the_device_is_done_only_once_its_copy_landed(gate):
    """The swap manager's host->device move completes on the copy's completion: its view is refused until
    then, and holds the bytes after."""
    with SwapManager(SwapConfig(host_budget=1 << 20, prefetch_bytes=0)) as mgr:
        mgr.register("a", dtype=torch.float32, shape=(1024,), home="host", data=torch.arange(1024.0)).wait()
        handle = mgr.fetch("a", "device")
        assert not handle.done()
        gate.open()
        handle.wait(WAIT)
        assert torch.equal(mgr.view("a"), torch.arange(1024.0))
        mgr.release("a")


def test_the_device_tier_lends_pool_pages_without_cuda():
    """Reserved bytes (a gathered unit's full buffer) can take the pool's pages: the second loan of the same
    size reuses the first one's buffer instead of allocating."""
    tier = DeviceTier(1 << 20, torch.device("cpu"))
    try:
        tier.reserve(8192, "unit", "gathered units")
        first = tier.lend(8192, "unit")
        first.release()
        second = tier.lend(8192, "unit")
        assert tier.pool.allocations == 1 and second.capacity == 8192
        second.release()
        tier.unreserve(8192, "gathered units")
        assert tier.in_use == 0
    finally:
        tier.close()


# -- with CUDA --------------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_device_has_an_index():
    tiers = [DeviceTier(None), DeviceTier(None, torch.device("cuda"))]
    try:
        assert all(tier.device == torch.device("cuda", torch.cuda.current_device()) for tier in tiers)
    finally:
        for tier in tiers:
            tier.close()


@pytest.mark.cuda
def test_cuda_copy_follows_the_callers_stream_and_compute_waits_on_its_event():
    """The source is written on a side stream the caller made current (behind a long kernel): the copy runs
    behind that write, not behind the copy thread's default stream. The bytes copied back to the device are
    read by the caller's stream after `event.wait()`, which makes the stream wait, not the host."""
    tier = DeviceTier(None)
    try:
        side = torch.cuda.Stream()
        src = torch.zeros(1 << 20, device="cuda")
        host = torch.empty(1 << 20, pin_memory=True)
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # keep the side stream busy
            src.fill_(7.0)
            handle = Handle(label="d2h")
            tier.copy(host, src, handle)
        handle.wait(WAIT)
        assert bool((host == 7.0).all())
        back = torch.empty(1 << 20, device="cuda")
        host.fill_(3.0)
        event = tier.copy(back, host)
        event.wait()  # the current stream waits
        assert float(back.sum()) == 3.0 * (1 << 20)
    finally:
        tier.close()
