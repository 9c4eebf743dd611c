"""The copy stream: the lane every host<->device copy runs on, apart from compute, each copy with its completion
event.

With CUDA it is a CUDA stream of its own. Without CUDA a copy worker thread stands in for it, so the rules a GPU
needs run on CPU, and in CI, too: a copy is asynchronous, nothing reads what it writes before its event, and no
buffer it reads or writes is reused, handed over or freed before its event. Copies run in the order they were
submitted. Submitting never waits for a copy, so copies pipeline.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch


class CopyEvent:
    """The completion of one copy. `wait()` makes the caller's compute wait for it: with CUDA the caller's current
    stream waits, not the host; without CUDA the caller's thread (the compute stream's stand-in) does.
    `synchronize()` makes the host wait. Both raise the copy's error; `done()` polls."""

    def wait(self) -> None:
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError

    def done(self) -> bool:
        raise NotImplementedError


class CopyStream:
    """Where copies run. `mark()` is the point the caller's compute has reached: a copy submitted later, from
    any thread, with `after=mark` runs behind it. `submit(dst, src, after)` queues `dst.copy_(src)` behind
    `after` (None: behind what the submitting thread's current stream has queued) and returns its event."""

    def mark(self) -> object:
        raise NotImplementedError

    def submit(self, dst: torch.Tensor, src: torch.Tensor, after: object = None) -> CopyEvent:
        raise NotImplementedError

    def close(self) -> None:
        """Return once every copy submitted has run."""


def copy_stream_for(device: torch.device) -> CopyStream:
    """The CUDA stream for a CUDA device, the copy worker for any other."""
    return CudaCopyStream(device) if device.type == "cuda" else WorkerCopyStream()


class _WorkerEvent(CopyEvent):
    __slots__ = ("_future",)

    def __init__(self, future: Future):
        self._future = future

    def wait(self) -> None:
        self._future.result()

    synchronize = wait  # the caller's thread is both the host and the compute stream

    def done(self) -> bool:
        return self._future.done()


class WorkerCopyStream(CopyStream):
    """Without CUDA: one copy worker thread runs the copies, one at a time in submission order, as a copy
    engine would."""

    def __init__(self) -> None:
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="tiering-copy")

    def mark(self) -> None:
        return None  # compute runs on the caller's thread: whatever it queued is done by the time it submits

    def submit(self, dst: torch.Tensor, src: torch.Tensor, after: object = None) -> CopyEvent:
        return _WorkerEvent(self._worker.submit(self.run, dst, src))

    @staticmethod
    def run(dst: torch.Tensor, src: torch.Tensor) -> None:
        """What the copy engine does (tests slow it down here)."""
        dst.copy_(src)

    def close(self) -> None:
        self._worker.shutdown(wait=True)


class _CudaEvent(CopyEvent):
    __slots__ = ("_device", "_event", "_error")

    def __init__(self, device: torch.device, event: torch.cuda.Event | None, error: BaseException | None = None):
        self._device, self._event, self._error = device, event, error

    def wait(self) -> None:
        if self._error is not None:
            raise self._error
        torch.cuda.current_stream(self._device).wait_event(self._event)

    def synchronize(self) -> None:
        if self._error is not None:
            raise self._error
        self._event.synchronize()

    def done(self) -> bool:
        return self._error is not None or self._event.query()


class CudaCopyStream(CopyStream):
    def __init__(self, device: torch.device):
        self.device = device
        # The one stream for host<->device copies, created here and nowhere else: on the compute stream a copy
        # would wait behind the kernels queued before it and hold back those queued after it; on a stream of
        # its own it runs on a copy engine while the kernels run.
        self.stream = torch.cuda.Stream(device)

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))  # the caller's stream, on the caller's thread
        return event

    def submit(self, dst: torch.Tensor, src: torch.Tensor, after: object = None) -> CopyEvent:
        try:
            # Behind the compute that wrote `src` or last read `dst`'s old bytes.
            self.stream.wait_event(after if after is not None else self.mark())
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)  # asynchronous for the host from pinned host memory
            for tensor in (dst, src):
                if tensor.is_cuda:
                    # Device memory crossing onto this stream: freed on the stream it was allocated on, its
                    # block is reused by the caching allocator only once this copy has run.
                    tensor.record_stream(self.stream)
            done = torch.cuda.Event(blocking=True)  # its waiter (the completion thread) sleeps, not spins
            done.record(self.stream)
        except Exception as exc:  # raised by the event, as a failed copy on the worker is
            return _CudaEvent(self.device, None, exc)
        return _CudaEvent(self.device, done)
