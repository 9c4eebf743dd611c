"""The CPU-Adam arithmetic: one Adam or AdamW step over flat fp32 tensors, in place, at memory bandwidth.

A step reads param, grad, exp_avg and exp_avg_sq and writes param, exp_avg and exp_avg_sq: 28 bytes per
parameter, and on a CPU that traffic, not the arithmetic, sets the speed. Our C kernel (zero/optim/adam_kernel.c,
built as `zero.optim._adam_kernel`) makes one pass, the gradient scale folded in and the bf16/fp16 copy-out (what
the device reads next) written from registers: 2 bytes more per parameter, not a second pass over the fp32
params. It computes what torch's fused CPU kernel (`torch._fused_adamw_` / `_fused_adam_`) computes, bit for
bit; a probe checks that once per process, and where ours is not built or differs (another torch build or
CPU), torch's kernel steps instead, then the copy-out (`kernel_choice()` says which and why). torch rounds the
last numel % 8 elements of each tensor it steps its own way: a step over a flat buffer of several parameters
names those elements (`tails`, `param_tails`), so that it equals torch stepping each parameter. A step with
several threads runs our kernel on torch's own OpenMP team (one call, split in C) where that team is found,
else on our threads (AdamThreads), each taking the next block; the kernel releases the GIL while it runs.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch

BLOCK = 1 << 20
"""Elements per piece of work on our threads (4 MiB per fp32 tensor, ~1 ms on one thread): its Python cost
(a few us) is lost in it, and a 100M-element step still has ~100 pieces for threads to share when one of
them is slowed by a busy core. A multiple of 8, so that only a tensor's last block has the tail that torch's
kernel rounds its own way (its last numel % 8 elements): blocks step as one call over the tensor would."""

OUT_DTYPES = (torch.bfloat16, torch.float16)
"""Dtypes the copy-out writes: what a device computes in."""

_OUT_KINDS = {torch.bfloat16: 1, torch.float16: 2}  # the C kernel's codes for the copy-out dtypes (0: none)

_FP32_MAX = torch.finfo(torch.float32).max


class AdamInputError(ValueError):
    """The tensors handed to `adam_step` do not fit together (dtype, device, layout or element count), or
    a hyperparameter is out of range; the message names the argument and carries the numbers."""


class AdamThreads:
    """`count` threads for `adam_step`: the calling thread and `count - 1` helpers, each taking the next
    undone piece of work (`run`).

    A piece is one block's C kernel call, which releases the GIL while it streams the block, so the threads
    run in parallel, and a thread on a busy core simply takes fewer blocks. The caller works too, rather
    than wait for helpers to wake and then for itself to be woken (on a busy machine, each can take ms).

    Where torch's fused kernel steps instead (`kernel_choice()`), a piece is torch ops that must run on
    their thread alone, not split again over torch's pool: `omp_set_num_threads`, which acts on the calling
    thread only, sets 1 for good on the helpers and on the caller for the duration of a run (then restored),
    so torch's setting, for every other thread, never changes. Where torch is not built with OpenMP that
    call is missing: `serial_ops` is then False and those ops use torch's pool, with the same results.
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
            with self._serial_caller():
                drain()
        finally:
            wait(helping)
        for future in helping:
            future.result()

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
    def _serial_caller(self) -> Iterator[None]:
        before = torch.get_num_threads()  # also torch's lazy per-thread setup, as above
        if self._set_omp_threads is None or before == 1:
            yield
            return
        self._set_omp_threads(1)
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
    tails: Sequence[tuple[int, int]] | None = None,
) -> None:
    """One Adam step of `param` in place, with `exp_avg` and `exp_avg_sq` updated in place.

    The arithmetic is torch.optim.AdamW's (`decoupled=True`: param *= 1 - lr * weight_decay) or
    torch.optim.Adam's (`decoupled=False`: grad += weight_decay * param), with bias correction for `step`
    (1-based: the count of steps including this one), rounded as torch's fused kernel rounds it. `grad_scale`
    multiplies the gradient in the same pass (loss-scale unscale times clipping coefficient); when it is not
    1, `grad` is left holding the scaled gradient (torch's kernel stores it back), otherwise `grad` is only
    read. `out`, a bf16 or fp16 tensor of the same element count, receives the updated param, rounded as
    `param.to(out.dtype)` rounds. `tails`: where the tensors are the flat buffer of several parameters (or a
    slice of it), the (start, stop) spans of their last numel % 8 elements (`param_tails`), which torch's
    kernel, stepping each parameter as its own tensor, rounds its own way; None: the tensors are one parameter.

    All tensors are contiguous CPU tensors (fp32 but `out`) of one element count, any shape: they are read
    as flat. With `threads`, the step runs on that many threads in our kernel when it is in use: one call on
    torch's OpenMP team (whose workers, spinning after torch's last op, start at once, where ours would
    share their cores with them), or block by block on `threads` (`adam_blocks`). Without, the calling
    thread calls torch's fused kernel (on torch's intra-op threads), then copies out, as
    torch.optim.AdamW(fused=True) would. Allocates nothing proportional to the tensors.
    """
    hyper = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                 decoupled=decoupled, grad_scale=grad_scale)
    if threads is None:
        flats = _prepare(param, grad, exp_avg, exp_avg_sq, out, hyper)
        return _torch_block(*flats, hyper, _check_tails(tails, param.numel()))
    kernel = _kernel()[0]
    if kernel is not None and kernel.team and threads.count > 1:
        flats = _prepare(param, grad, exp_avg, exp_avg_sq, out, hyper)
        return _kernel_block(kernel, *flats, hyper, _check_tails(tails, param.numel()), threads=threads.count)
    threads.run(adam_blocks(param, grad, exp_avg, exp_avg_sq, out=out, tails=tails, **hyper))


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
    tails: Sequence[tuple[int, int]] | None = None,
) -> list[Callable[[], None]]:
    """`adam_step` (same arguments, checked now) as independent pieces of work, one per BLOCK elements,
    each updating its block and writing its copy-out: run them in any order, on any threads, each once
    (`AdamThreads.run`). An optimizer with many params runs all its params' pieces in one go, so small
    params do not each pay a hand-off to the threads. The pieces hold views of the tensors, not copies."""
    hyper = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                 decoupled=decoupled, grad_scale=grad_scale)
    *flats, flat_out = _prepare(param, grad, exp_avg, exp_avg_sq, out, hyper)
    numel = flats[0].numel()
    tails = _check_tails(tails, numel)
    kernel = _kernel()[0]
    run = functools.partial(_kernel_block, kernel) if kernel is not None else _torch_block
    if numel <= BLOCK:  # most params: spare the splits (a few us each)
        return [functools.partial(run, *flats, flat_out, hyper, tails)]
    outs = flat_out.split(BLOCK) if flat_out is not None else itertools.repeat(None)
    # BLOCK is a multiple of 8: a tensor's tail (tails None) is its last block's own
    return [functools.partial(run, *views, hyper, None if tails is None else _within(tails, start, BLOCK))
            for start, *views in zip(range(0, numel, BLOCK), *(t.split(BLOCK) for t in flats), outs)]


def param_tails(extents: Iterable[tuple[int, int]], index: int, numel: int) -> tuple[tuple[int, int], ...]:
    """The `tails` of `adam_step` over elements [index, index + numel) of a flat buffer whose parameters lie at
    `extents` ((offset, numel) each): each parameter's last numel % 8 elements there, counted from `index`."""
    ends = sorted((offset + size - size % 8, offset + size) for offset, size in extents if size % 8)
    return _within(ends, index, numel)


def _within(spans, start: int, numel: int) -> tuple[tuple[int, int], ...]:
    """The parts of `spans` in [start, start + numel), counted from `start`."""
    stop = start + numel
    return tuple((max(a, start) - start, min(b, stop) - start) for a, b in spans if a < stop and b > start)


def _check_tails(tails, numel: int) -> tuple[tuple[int, int], ...] | None:
    """`tails` as a tuple of (start, stop) pairs, checked: sorted, disjoint, in [0, numel), each under 8."""
    if tails is None:
        return None
    checked, last = [], 0
    for span in tails:
        start, stop = (int(x) for x in span)
        if not last <= start < stop <= min(numel, start + 7):
            raise AdamInputError(f"tails: ({start}, {stop}) after a span stopping at {last}: tails are sorted, "
                                 f"disjoint spans of 1 to 7 of the {numel} elements")
        checked.append((start, stop))
        last = stop
    return tuple(checked)


def kernel_choice() -> str:
    """Which kernel `adam_step` runs on our threads, and why: the C kernel (naming its loop: avx512, avx2 or
    scalar), or torch's fused kernel because ours is not built or differs from torch's on this machine."""
    return _kernel()[1]


@functools.cache
def _kernel():
    """(the C kernel module, a note) when it is built and matches torch's fused kernel bit for bit on a
    probe; else (None, why not). Once per process, at the first step on our threads."""
    try:
        from . import _adam_kernel
    except ImportError as e:
        return None, f"torch's fused kernel: zero.optim._adam_kernel is not built ({e})"
    try:
        differs = _probe(_adam_kernel)
    except (TypeError, ValueError) as e:  # built from an older source: `pip install -e .` rebuilds it
        differs = f"{type(e).__name__}: {e}"
    if differs:
        return None, f"torch's fused kernel: zero.optim._adam_kernel differs from it on this machine ({differs})"
    return _adam_kernel, f"the C kernel ({_adam_kernel.paths[0]} loop)"


def _probe(kernel) -> str | None:
    """Step random tensors through `kernel` and torch's fused kernel with every option that changes the
    arithmetic; the first difference in bits, or None. 1021 elements: vector loops and both tails run."""
    gen = torch.Generator().manual_seed(0)
    options = itertools.product((True, False), (0.0, 0.1), (1.0, 0.37), (0.9, 0.3))
    for i, (decoupled, weight_decay, grad_scale, beta1) in enumerate(options):
        hyper = dict(step=3, lr=0.01, beta1=beta1, beta2=0.99, eps=1e-8, weight_decay=weight_decay,
                     decoupled=decoupled, grad_scale=grad_scale)
        ours = [torch.randn(1021, generator=gen) for _ in range(3)] + [torch.rand(1021, generator=gen)]
        ours[0][:4] = torch.tensor([math.inf, math.nan, 3e38, 1e-41])
        theirs, out = [t.clone() for t in ours], torch.empty(1021, dtype=OUT_DTYPES[i % 2])
        _kernel_block(kernel, *ours, out, hyper)
        _torch_block(*theirs, None, hyper)
        for name, a, b in zip(("param", "grad", "exp_avg", "exp_avg_sq", "out"), ours + [out],
                              theirs + [theirs[0].to(out.dtype)]):
            if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                return f"{name} differs, step options {hyper}"
    return None


def _kernel_block(kernel, p, g, m, v, o, hyper, tails=None, threads: int = 1) -> None:
    """One step of these flat views in the C kernel, the copy-out written in the same pass (`threads` > 1:
    on torch's OpenMP team)."""
    kernel.step(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 0 if o is None else o.data_ptr(),
                0 if o is None else _OUT_KINDS[o.dtype], p.numel(), threads=threads, tails=tails, **hyper)


def _torch_block(p, g, m, v, o, hyper, tails=None) -> None:
    """One step of these flat views in torch's fused kernel, then the copy-out."""
    if tails is None:
        torch_fused_step(p, g, m, v, **hyper)
    else:
        _torch_tails(p, g, m, v, hyper, tails)
    if o is not None:
        o.copy_(p)


def _torch_tails(p, g, m, v, hyper, tails) -> None:
    """torch's fused kernel over flat views, its tail rounding on `tails` alone. It rounds each tensor's last
    numel % 8 elements so: the views are cut into tensors that are a tail or a multiple of 8 elements, and a
    run of under 8 before a tail (or the end) steps in a copy padded with zeros to 8, then copied back."""
    cuts, short, at = [], [], 0
    for start, stop in (*tails, (p.numel(), p.numel())):
        body = start - (start - at) % 8
        cuts += [(at, body)] if body > at else []
        short += [(body, start)] if start > body else []
        cuts += [(start, stop)] if stop > start else []
        at = stop
    tensors = (p, g, m, v)
    copies = [[torch.cat((t[a:b], t.new_zeros(8 - (b - a)))) for a, b in short] for t in tensors]
    _fused(*([t[a:b] for a, b in cuts] + padded for t, padded in zip(tensors, copies)), **hyper)
    for t, padded in zip(tensors, copies):
        for (a, b), copy in zip(short, padded):
            t[a:b] = copy[: b - a]


def torch_fused_step(p, g, m, v, *, step: int, lr: float, beta1: float, beta2: float, eps: float,
                     weight_decay: float, decoupled: bool, grad_scale: float) -> None:
    """One step of torch's fused Adam(W) kernel over fp32 tensors on any device (CPU, or the GPU where the
    optimizer state stays on the device); the reference our C kernel equals bit for bit."""
    _fused([p], [g], [m], [v], step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
           decoupled=decoupled, grad_scale=grad_scale)


def _fused(ps, gs, ms, vs, *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
           decoupled: bool, grad_scale: float) -> None:
    """torch's fused Adam(W) kernel over lists of tensors, each stepped as its own parameter."""
    if not ps:
        return
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    device = ps[0].device
    steps = [torch.tensor(float(step), dtype=torch.float32, device=device)] * len(ps)
    kernel(ps, gs, ms, vs, [], steps, lr=lr,
           beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
           # The kernel divides by grad_scale: multiplying by the factor is dividing by its inverse. At 1.0 no
           # scale is passed, so the unscaled path is exactly torch's and grad is not written.
           grad_scale=None if grad_scale == 1.0 else torch.tensor(1.0 / grad_scale, dtype=torch.float32,
                                                                     device=device))


def _prepare(param, grad, exp_avg, exp_avg_sq, out, hyper) -> list[torch.Tensor | None]:
    """Check the arguments; return the four fp32 tensors and `out` (or None) as flat views."""
    _check_tensors(param, grad, exp_avg, exp_avg_sq, out)
    check_hyperparameters(**{name: value for name, value in hyper.items() if name != "decoupled"})
    # Detached: autograd neither records nor checks these in-place writes, in whichever thread they run.
    return [t.detach().view(-1) if t is not None else None for t in (param, grad, exp_avg, exp_avg_sq, out)]


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
