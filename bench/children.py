"""A bench's roles, each in a process of its own that starts in milliseconds: forks of one server process that
imported the heavy modules once (torch, transformers, peft, zero: 6-8 s a process on a 2-core machine).

Why a process per role: each one's peak RSS is its own and nothing of the role before it is left in memory (an
allocator's cache, a model not yet collected). The server imports only: no CUDA call happens before a fork, so a
child initializes CUDA itself, as a fresh process would (torch, transformers, peft and zero probe no device at
import). A child's peak RSS (VmHWM) counts the modules' pages as a process that imported them itself would.
"""
from __future__ import annotations

import multiprocessing
import traceback
from typing import Callable

PRELOAD = ["torch", "transformers", "peft", "zero"]


def vm_hwm() -> int:
    """This process's own high-water RSS (VmHWM: ru_maxrss of a child also counts its parent's at the fork)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _serve(send, role: Callable, args: tuple) -> None:
    try:
        send.send(("done", role(*args), vm_hwm()))  # (a result that does not pickle raises here, nothing sent)
    except BaseException:  # noqa: BLE001  (reported to the bench, which fails naming the role)
        send.send(("failed", traceback.format_exc(), 0))
    send.close()


def run(role: Callable, *args, preload: list[str] = PRELOAD) -> tuple[object, int]:
    """`role(*args)` in a fresh fork of the server (started by the first call, importing that call's `preload`): what
    it returned and its peak RSS in bytes. `role` is a module-level function; its arguments and result pickle; its
    environment is the server's (this process's when the server started: what a role needs, it sets itself).
    SystemExit naming the role where it raised or its process died."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(preload)
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_serve, args=(send, role, args))
    process.start()
    send.close()
    try:
        status, result, peak = receive.recv()
    except EOFError:  # it died before it could say (a signal, os._exit)
        status, result, peak = "failed", "its process ended without a result", 0
    process.join()
    if status != "done":
        code = f" (exit code {process.exitcode})" if process.exitcode else ""
        raise SystemExit(f"{role.__module__}.{role.__name__} failed{code}:\n{result[-4000:]}")
    return result, peak
