"""The CPU-Adam arithmetic: one Adam or AdamW step over flat fp32 tensors, in place, at memory bandwidth.

A step reads param, grad, exp_avg and exp_avg_sq and writes param, exp_avg and exp_avg_sq: 28 bytes per
parameter, and on a CPU that traffic, not the arithmetic, sets the speed. torch's fused CPU kernel
(`torch._fused_adamw_` / `torch._fused_adam_`, vectorized C++ over torch's intra-op threads) makes exactly
one pass, so we call it rather than compose torch ops (one pass each). What this adds: the gradient scale
folded into that pass; the bf16/fp16 copy-out (what the device reads next) done block by block right after
each block's update, while the block's params are still in cache, so it adds the 2 bytes written per
parameter and not a second read of the fp32 params from memory; and our own threads (AdamThreads), which
stream blocks independently instead of fork-joining torch's pool for every op.
"""
from __future__ import annotations

import ctypes
import itertools
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

BLOCK = 1 << 18
"""Elements per block on our threads: 1 MiB per fp32 tensor, so a block's params stay in the caches (1 MiB
L2 per core here) between their update and their copy-out, and the per-block Python cost (a few
microseconds) stays small against the block's update (~0.2 ms at memory bandwidth)."""

OUT_DTYPES = (torch.bfloat16, torch.float16)
"""Dtypes the copy-out writes: what a device computes in."""

_FP32_MAX = torch.finfo(torch.float32).max


class AdamInputError(ValueError):
    """The tensors handed to `adam_step` do not fit together (dtype, device, layout or element count), or
    a hyperparameter is out of range; the message names the argument and carries the numbers."""


class AdamThreads:
    """The threads `adam_step` runs on: `count` Python threads, each taking the next undone block and running
    its torch ops on itself alone (torch ops release the GIL while they compute).

    Why not torch's intra-op pool: it splits every op across all its threads and joins them at the op's end,
    so a step of many blocks is many fork-joins, each stalled by any core another process holds, and the
    copy-out (compute bound, in cache) runs on every core at once while memory idles. Independent threads
    stream their own blocks: one thread's copy-out overlaps the other's memory traffic, and a thread on a
    busy core simply takes fewer blocks.

    Each worker sets its own OpenMP thread count to 1 (`omp_set_num_threads` acts on the calling thread
    only; nothing process-wide changes, torch's setting for other threads included). Where torch is not
    built with OpenMP that call is missing: `serial_ops` is then False and the workers' ops fork into torch's
    pool, with the same results and more contention. Starting the threads costs ~0.1-1 ms: keep one for
    many steps; `close()` (or a `with` block) ends them.
    """

    def __init__(self, count: int | None = None):
        count = torch.get_num_threads() if count is None else count
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise AdamInputError(f"AdamThreads count = {count!r}: an int >= 1, or None for torch.get_num_threads()")
        self.count = count
        self._pool = ThreadPoolExecutor(count, thread_name_prefix="cpu-adam")
        started = threading.Barrier(count)
        # One task per thread, all waiting on a barrier: every thread starts now and sets itself up once.
        self.serial_ops = all(self._pool.map(lambda _: _ops_on_this_thread_only(started), range(count)))

    def run(self, work: Sequence[Callable[[], None]]) -> None:
        """Call each of `work` once, on the threads, each thread taking the next undone one; return when all
        are done, raising the first error any raised."""
        pending = iter(work)  # next() on a list iterator is one C call under the GIL: atomic, no lock needed

        def drain() -> None:
            for item in pending:
                item()

        for future in [self._pool.submit(drain) for _ in range(min(self.count, len(work)))]:
            future.result()

    def close(self) -> None:
        self._pool.shutdown()

    def __enter__(self) -> AdamThreads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ops_on_this_thread_only(started: threading.Barrier) -> bool:
    """Make the torch ops this thread calls run on it alone; True if that held."""
    torch.get_num_threads()  # torch's lazy per-thread setup: run it first, or it would later undo the next call
    set_count = getattr(ctypes.CDLL(None), "omp_set_num_threads", None)
    if set_count is not None:
        set_count(1)
    started.wait()
    return torch.get_num_threads() == 1


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    decoupled: bool = True,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
    threads: AdamThreads | None = None,
) -> None:
    """One Adam step of `param` in place, with `exp_avg` and `exp_avg_sq` updated in place.

    The arithmetic is torch.optim.AdamW's (`decoupled=True`: param *= 1 - lr * weight_decay) or
    torch.optim.Adam's (`decoupled=False`: grad += weight_decay * param), with bias correction for `step`
    (1-based: the count of steps including this one). `grad_scale` multiplies the gradient in the same pass
    (loss-scale unscale times clipping coefficient); when it is not 1, `grad` is left holding the scaled
    gradient (torch's kernel stores it back), otherwise `grad` is only read. `out`, a bf16 or fp16 tensor of
    the same element count, receives the updated param, rounded as `param.to(out.dtype)` rounds.

    All tensors are contiguous CPU tensors (fp32 but `out`) of one element count, any shape: they are read
    as flat. With `threads`, the step runs on those threads, block by block (`adam_blocks`). Without, the
    calling thread makes one fused call over the whole tensor on torch's intra-op threads, then the
    copy-out, as torch.optim.AdamW(fused=True) would. Allocates nothing proportional to the tensors.
    """
    hyper = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                 decoupled=decoupled, grad_scale=grad_scale)
    if threads is not None:
        threads.run(adam_blocks(param, grad, exp_avg, exp_avg_sq, out=out, **hyper))
        return
    kernel, options, flats, flat_out = _prepare(param, grad, exp_avg, exp_avg_sq, out, **hyper)
    kernel(*([t] for t in flats), **options)
    if flat_out is not None:
        flat_out.copy_(flats[0])


def adam_blocks(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    decoupled: bool = True,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> list[Callable[[], None]]:
    """`adam_step` (same arguments, checked now) as independent pieces of work, one per BLOCK elements:
    each updates its block and then copies it out, while it is in cache. Run them in any order, on any
    threads, each once (`AdamThreads.run`); an optimizer with many params runs all its params' blocks in
    one go, so small params do not each pay a hand-off to the threads."""
    kernel, options, flats, flat_out = _prepare(param, grad, exp_avg, exp_avg_sq, out, step=step, lr=lr,
                                                beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                                                decoupled=decoupled, grad_scale=grad_scale)
    p, g, m, v = (t.split(BLOCK) for t in flats)
    o = flat_out.split(BLOCK) if flat_out is not None else [None] * len(p)

    def block(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, o: torch.Tensor | None):
        def run() -> None:
            kernel([p], [g], [m], [v], **options)
            if o is not None:
                o.copy_(p)
        return run

    return [block(*views) for views in zip(p, g, m, v, o)]


def _prepare(param, grad, exp_avg, exp_avg_sq, out, *, step, lr, beta1, beta2, eps, weight_decay, decoupled,
             grad_scale):
    """Check the arguments; return the fused kernel, its keyword arguments, the four fp32 tensors and `out`
    as flat views (or None)."""
    _check_tensors(param, grad, exp_avg, exp_avg_sq, out)
    check_hyperparameters(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                          grad_scale=grad_scale)
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    options = dict(
        max_exp_avg_sqs=[], state_steps=[torch.tensor(float(step), dtype=torch.float32)],
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
        # The kernel divides by grad_scale: multiplying by the factor is dividing by its inverse. At 1.0 no
        # scale is passed, so the unscaled path is exactly torch's and grad is not written.
        grad_scale=None if grad_scale == 1.0 else torch.tensor(1.0 / grad_scale, dtype=torch.float32),
    )
    # Detached: autograd neither records nor checks these in-place writes, in whichever thread they run.
    flats = [t.detach().view(-1) for t in (param, grad, exp_avg, exp_avg_sq)]
    return kernel, options, flats, out.detach().view(-1) if out is not None else None


def _check_tensors(param, grad, exp_avg, exp_avg_sq, out) -> None:
    numel = param.numel()
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32:
            raise AdamInputError(f"{name} is {t.dtype}: CPU-Adam steps fp32 tensors")
        _check_layout(name, t, numel)
    if out is not None:
        if out.dtype not in OUT_DTYPES:
            raise AdamInputError(f"out is {out.dtype}: the copy-out writes one of {OUT_DTYPES}")
        _check_layout("out", out, numel)


def _check_layout(name: str, t: torch.Tensor, numel: int) -> None:
    if t.device.type != "cpu":
        raise AdamInputError(f"{name} is on {t.device}: CPU-Adam steps CPU tensors")
    if t.layout != torch.strided or not t.is_contiguous():
        raise AdamInputError(f"{name} (shape {tuple(t.shape)}, strides {t.stride()}) is not a contiguous dense "
                             "tensor: CPU-Adam reads flat memory")
    if t.numel() != numel:
        raise AdamInputError(f"{name} has {t.numel()} elements, param has {numel}")


def check_hyperparameters(
    *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale: float,
) -> None:
    """Raise AdamInputError naming the first argument of `adam_step` out of its range (the optimizer class
    checks its param groups with this when they are added, not at the first step)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise AdamInputError(f"step = {step!r}: an int >= 1 (the count of steps including this one)")
    for name, value, ok, expected in (
        ("lr", lr, lambda x: x >= 0, ">= 0"),
        ("beta1", beta1, lambda x: 0 <= x < 1, "in [0, 1)"),
        ("beta2", beta2, lambda x: 0 <= x < 1, "in [0, 1)"),
        ("eps", eps, lambda x: x >= 0, ">= 0"),
        ("weight_decay", weight_decay, lambda x: x >= 0, ">= 0"),
        ("grad_scale", grad_scale, lambda x: 0 < x and 1 / x <= _FP32_MAX, "> 0 whose inverse fits fp32"),
    ):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and ok(value)):
            raise AdamInputError(f"{name} = {value!r}: a finite number {expected}")
