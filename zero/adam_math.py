"""The CPU-Adam arithmetic: one Adam or AdamW step over flat fp32 tensors, in place, at memory bandwidth.

A step reads param, grad, exp_avg and exp_avg_sq and writes param, exp_avg and exp_avg_sq: 28 bytes per
parameter, and on a CPU that traffic, not the arithmetic, sets the speed. torch's fused CPU kernel
(`torch._fused_adamw_` / `torch._fused_adam_`, vectorized C++ over torch's intra-op threads) makes exactly
one pass, so we call it rather than compose torch ops (one pass each). What this adds: the gradient scale
folded into that pass; the bf16/fp16 copy-out (what the device reads next) done block by block right after
each block's update, while the block's params are still in cache, so it adds the 2 bytes written per
parameter and not a second read of the fp32 params from memory; and a thread count per call
(AdamThreads), whose threads stream those blocks independently, so one thread's copy-out overlaps
another's memory traffic.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch

BLOCK = 1 << 20
"""Elements per block on our threads: 4 MiB per fp32 tensor, so a block's params are still in the caches
(32 MiB L3 here) when they are copied out right after their update, and the per-block Python cost (~10 us)
is about 1% of the block's update. Measured on the development machine, 50M elements, 2 threads: 256K
blocks lose ~10% to that cost, 512K to 4M are level within noise, 1M the best by a little."""

OUT_DTYPES = (torch.bfloat16, torch.float16)
"""Dtypes the copy-out writes: what a device computes in."""

_FP32_MAX = torch.finfo(torch.float32).max


class AdamInputError(ValueError):
    """The tensors handed to `adam_step` do not fit together (dtype, device, layout or element count), or
    a hyperparameter is out of range; the message names the argument and carries the numbers."""


class AdamThreads:
    """`count` threads for `adam_step`: the calling thread and `count - 1` helpers, run two ways.

    Blocks with a copy-out (`run`): each thread takes the next undone block and runs its torch ops on
    itself alone (torch ops release the GIL while they compute). torch's intra-op pool would split every op
    across all threads and join them at the op's end, so the copy-out (compute bound, in cache) would run
    on every core at once while memory idles; independent threads overlap one's copy-out with the other's
    memory traffic, and a thread on a busy core simply takes fewer blocks. The caller works too, rather
    than wait for helpers to wake and then for itself to be woken (on a busy machine, each can take ms).

    Whole tensors without a copy-out (`run_split`): one after another on the caller, each op split over
    `count` threads by torch's pool, exactly as torch's fused AdamW runs. There is nothing to overlap, and
    our threads measured a few percent slower there on this busy machine: each block needs the GIL back,
    and a sleeping thread must wait for a core, where the pool's threads spin.

    Thread counts are set with `omp_set_num_threads`, which acts on the calling thread only: 1 for good on
    the helpers, and on the caller for the duration of a run (then restored), so torch's setting,
    process-wide and for every other thread, never changes. Where torch is not built with OpenMP that call
    is missing: `serial_ops` is then False and our ops use torch's pool as configured, with the same results.
    Starting helpers costs ~0.1-1 ms: keep one AdamThreads for many steps; `close()` (or `with`) ends them.
    """

    def __init__(self, count: int | None = None):
        count = torch.get_num_threads() if count is None else count
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise AdamInputError(f"AdamThreads count = {count!r}: an int >= 1, or None for torch.get_num_threads()")
        self.count = count
        # torch's OpenMP runtime is already loaded: CDLL(None) finds the symbol among loaded libraries.
        self._set_omp_threads = getattr(ctypes.CDLL(None), "omp_set_num_threads", None)
        self._helpers = ThreadPoolExecutor(count - 1, thread_name_prefix="cpu-adam") if count > 1 else None
        self.serial_ops = self._set_omp_threads is not None
        if self._helpers is not None:
            started = threading.Barrier(count - 1)
            # One task per helper, all waiting on a barrier: every helper starts now and sets itself up once.
            self.serial_ops &= all(self._helpers.map(lambda _: self._serial_helper(started), range(count - 1)))

    def run(self, work: Sequence[Callable[[], None]]) -> None:
        """Call each of `work` once, on the caller and the helpers, each taking the next undone one, its
        torch ops on itself alone; return when all are done, raising the first error (the caller's, else a
        helper's)."""
        pending = iter(work)  # next() on a list iterator is one C call under the GIL: atomic, no lock needed

        def drain() -> None:
            for item in pending:
                item()

        helping = [self._helpers.submit(drain) for _ in range(min(self.count, len(work)) - 1)]
        try:
            with self._caller_threads(1):
                drain()
        finally:
            wait(helping)
        for future in helping:
            future.result()

    def run_split(self, work: Sequence[Callable[[], None]]) -> None:
        """Call each of `work` in turn on the caller, torch splitting each op over `count` threads."""
        with self._caller_threads(self.count):
            for item in work:
                item()

    def close(self) -> None:
        if self._helpers is not None:
            self._helpers.shutdown()

    def __enter__(self) -> AdamThreads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serial_helper(self, started: threading.Barrier) -> bool:
        torch.get_num_threads()  # torch's lazy per-thread setup: run it first, or it would later undo ours
        if self._set_omp_threads is not None:
            self._set_omp_threads(1)
        started.wait()
        return torch.get_num_threads() == 1

    @contextlib.contextmanager
    def _caller_threads(self, count: int) -> Iterator[None]:
        before = torch.get_num_threads()  # also torch's lazy per-thread setup, as above
        if self._set_omp_threads is None or before == count:
            yield
            return
        self._set_omp_threads(count)
        try:
            yield
        finally:
            self._set_omp_threads(before)


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
    as flat. With `threads`, the step runs on that many threads: with `out`, block by block, each block
    copied out while in cache (`adam_blocks`, `AdamThreads.run`); without, as one fused call split by
    torch's pool (`AdamThreads.run_split`). Without `threads`, the calling thread makes one fused call on
    torch's intra-op threads as configured, then the copy-out, as torch.optim.AdamW(fused=True) would.
    Allocates nothing proportional to the tensors.
    """
    hyper = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                 decoupled=decoupled, grad_scale=grad_scale)
    if threads is not None:
        work = adam_blocks(param, grad, exp_avg, exp_avg_sq, out=out, **hyper)
        (threads.run if out is not None else threads.run_split)(work)
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
    """`adam_step` (same arguments, checked now) as independent pieces of work. With `out`, one per BLOCK
    elements, each updating its block and then copying it out while it is in cache: run them in any order,
    on any threads, each once (`AdamThreads.run`). Without `out`, one piece, the whole tensor, for
    `AdamThreads.run_split`. An optimizer with many params runs all its params' pieces in one go, so small
    params do not each pay a hand-off to the threads."""
    kernel, options, flats, flat_out = _prepare(param, grad, exp_avg, exp_avg_sq, out, step=step, lr=lr,
                                                beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                                                decoupled=decoupled, grad_scale=grad_scale)
    block = BLOCK if flat_out is not None else max(flats[0].numel(), 1)
    p, g, m, v = (t.split(block) for t in flats)
    o = flat_out.split(block) if flat_out is not None else [None] * len(p)

    def piece(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, o: torch.Tensor | None):
        def run() -> None:
            kernel([p], [g], [m], [v], **options)
            if o is not None:
                o.copy_(p)
        return run

    return [piece(*views) for views in zip(p, g, m, v, o)]


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
