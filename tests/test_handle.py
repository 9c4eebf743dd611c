"""Handles: done only when every part is in (also after an error), the first error raised by wait(),
callbacks run once on completion, gather() combines handles and keeps their errors."""
from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from tiering import Handle, completed, gather


def test_single_part_done_and_wait():
    h = Handle(1, label="one")
    assert not h.done() and h.error is None
    with pytest.raises(TimeoutError, match="one"):
        h.wait(timeout=0.01)
    h.part_done()
    assert h.done() and h.error is None
    h.wait(timeout=0)
    assert "done" in repr(h)


def test_zero_parts_and_completed_are_done_at_once():
    assert Handle(0).done()
    c = completed("nothing")
    assert c.done()
    c.wait(timeout=0)


def test_done_only_after_every_part():
    h = Handle(3)
    h.part_done()
    h.part_done()
    assert not h.done()
    h.part_done()
    assert h.done()


def test_error_is_kept_but_wait_blocks_until_every_part_is_in():
    h = Handle(3, label="x")
    first, second = OSError(5, "first"), OSError(5, "second")
    h.part_done(first)
    assert not h.done()
    assert h.error is None  # not known as the outcome before every part is in
    with pytest.raises(TimeoutError):
        h.wait(timeout=0.01)  # the error must not make wait() return while parts are in flight
    h.part_done(second)
    h.part_done()
    assert h.done() and h.error is first
    with pytest.raises(OSError) as info:
        h.wait()
    assert info.value is first
    assert "failed" in repr(h)


def test_wait_from_another_thread_returns_only_after_all_parts():
    h = Handle(4)
    finished: list[float] = []
    raised: list[BaseException] = []

    def waiter():
        try:
            h.wait(timeout=5)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            raised.append(exc)
        finished.append(time.monotonic())

    t = threading.Thread(target=waiter)
    t.start()
    error = ValueError("block 0 failed")
    h.part_done(error)
    time.sleep(0.05)
    assert not finished, "wait() returned while 3 parts were still in flight"
    last_part = None
    for _ in range(3):
        time.sleep(0.01)
        last_part = time.monotonic()
        h.part_done()
    t.join(5)
    assert finished and finished[0] >= last_part
    assert raised == [error]


def test_callbacks_run_once_on_completion_and_immediately_when_done():
    h = Handle(2)
    seen: list[tuple[str, object]] = []
    h.add_done_callback(lambda x: seen.append(("a", x)))
    h.add_done_callback(lambda x: seen.append(("b", x)))
    h.part_done()
    assert seen == []
    h.part_done()
    assert seen == [("a", h), ("b", h)]
    h.add_done_callback(lambda x: seen.append(("late", x)))
    assert seen[-1] == ("late", h)
    assert len(seen) == 3


def test_callback_sees_the_error():
    h = Handle(1)
    errors = []
    h.add_done_callback(lambda x: errors.append(x.error))
    boom = RuntimeError("boom")
    h.part_done(boom)
    assert errors == [boom]


def test_raising_callback_does_not_hang_the_handle_or_skip_others():
    h = Handle(1)
    seen = []

    def bad(_):
        raise RuntimeError("callback bug")

    h.add_done_callback(bad)
    h.add_done_callback(lambda x: seen.append(x))
    h.part_done()  # on an engine thread this exception would kill the reaper
    assert h.done() and seen == [h]
    h.wait(timeout=1)


def test_keepalive_is_dropped_when_done():
    buffer = torch.empty(4096, dtype=torch.uint8)
    ref = weakref.ref(buffer)
    h = Handle(2, keepalive=buffer)
    del buffer
    gc.collect()
    assert ref() is not None, "the handle must keep its buffer alive while parts are in flight"
    h.part_done()
    gc.collect()
    assert ref() is not None
    h.part_done()
    gc.collect()
    assert ref() is None


def test_gather_done_when_all_done():
    hs = [Handle(1) for _ in range(3)]
    g = gather(hs, label="all")
    for h in hs[:2]:
        h.part_done()
    assert not g.done()
    hs[2].part_done()
    assert g.done() and g.error is None
    g.wait(timeout=0)


def test_gather_propagates_the_error():
    hs = [Handle(1) for _ in range(3)]
    g = gather(hs)
    error = OSError(28, "No space left on device")
    hs[1].part_done(error)
    hs[0].part_done()
    assert not g.done()
    hs[2].part_done()
    assert g.done()
    assert g.error is error
    with pytest.raises(OSError) as info:
        g.wait(timeout=1)
    assert info.value is error


def test_gather_of_already_failed_and_done_handles():
    failed = Handle(1)
    error = ValueError("earlier")
    failed.part_done(error)
    g = gather([completed(), failed])
    assert g.done()
    with pytest.raises(ValueError):
        g.wait()


def test_gather_of_nothing_and_nested():
    assert gather([]).done()
    a, b = Handle(1), Handle(1)
    outer = gather([gather([a]), gather([b])])
    a.part_done(KeyError("k"))
    assert not outer.done()
    b.part_done()
    with pytest.raises(KeyError):
        outer.wait(timeout=1)


def test_parts_completed_from_many_threads():
    parts = 400
    h = Handle(parts)
    g = gather([h])
    barrier = threading.Barrier(8)

    def worker(n):
        barrier.wait()
        for _ in range(n):
            h.part_done()

    threads = [threading.Thread(target=worker, args=(parts // 8,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert h.done() and g.done()
    g.wait(timeout=0)
