"""The CPU-Adam arithmetic: one Adam or AdamW step over flat fp32 tensors, in place, at memory bandwidth.

A step reads param, grad, exp_avg and exp_avg_sq and writes param, exp_avg and exp_avg_sq: 28 bytes per
parameter, and on a CPU that traffic, not the arithmetic, sets the speed. torch's fused CPU kernel
(`torch._fused_adamw_` / `torch._fused_adam_`, vectorized C++ over torch's intra-op threads) makes exactly
one pass, so we call it rather than compose torch ops (one pass each). What this adds: the gradient scale
folded into that pass, and the bf16/fp16 copy-out (what the device reads next) done block by block right
after each block's update, while the block's params are still in cache, so it adds the 2 bytes written per
parameter and not a second read of the fp32 params from memory.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

BLOCK = 1 << 18
"""Elements per block of the copy-out: 1 MiB per fp32 tensor, so one block's params stay in the caches
(1 MiB L2 per core here) between their update and their copy-out. Large enough that the per-block Python
cost (a few microseconds) stays small against the block's update (~150 us at memory bandwidth)."""

SERIAL_BELOW = 32768
"""Tensors smaller than this are stepped by one thread: waking torch's pool costs more than it saves there
(torch's elementwise ops do not fork below this grain either; its fused Adam kernel forks at any size), and
on a busy machine a fork can wait milliseconds for a core."""

OUT_DTYPES = (torch.bfloat16, torch.float16)
"""Dtypes the copy-out writes: what a device computes in."""

_FP32_MAX = torch.finfo(torch.float32).max


class AdamInputError(ValueError):
    """The tensors handed to `adam_step` do not fit together (dtype, device, layout or element count), or
    a hyperparameter is out of range; the message names the argument and carries the numbers."""


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
    threads: int | None = None,
) -> None:
    """One Adam step of `param` in place, with `exp_avg` and `exp_avg_sq` updated in place.

    The arithmetic is torch.optim.AdamW's (`decoupled=True`: param *= 1 - lr * weight_decay) or
    torch.optim.Adam's (`decoupled=False`: grad += weight_decay * param), with bias correction for `step`
    (1-based: the count of steps including this one). `grad_scale` multiplies the gradient in the same pass
    (loss-scale unscale times clipping coefficient); when it is not 1, `grad` is left holding the scaled
    gradient (torch's kernel stores it back), otherwise `grad` is only read. `out`, a bf16 or fp16 tensor of
    the same element count, receives the updated param, rounded as `param.to(out.dtype)` rounds.

    All tensors are contiguous CPU tensors (fp32 but `out`) of one element count, any shape: they are read
    as flat. `threads` is the most intra-op threads this call uses (None: torch's current setting; tensors
    under SERIAL_BELOW elements use one); a count other than torch's is set for the call and then restored.
    Allocates nothing proportional to the tensors.
    """
    numel = _check_tensors(param, grad, exp_avg, exp_avg_sq, out)
    check_hyperparameters(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                          grad_scale=grad_scale, threads=threads)
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    options = dict(
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
        # The kernel divides by grad_scale: multiplying by the factor is dividing by its inverse. At 1.0 no
        # scale is passed, so the unscaled path is exactly torch's and grad is not written.
        grad_scale=None if grad_scale == 1.0 else torch.tensor(1.0 / grad_scale, dtype=torch.float32),
    )
    steps = [torch.tensor(float(step), dtype=torch.float32)]
    flats = [t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq)]
    with _intra_op_threads(1 if numel < SERIAL_BELOW else threads):
        if out is None or numel <= BLOCK:
            kernel(*([t] for t in flats), [], steps, **options)
            if out is not None:
                out.view(-1).copy_(flats[0])
            return
        blocks = [t.split(BLOCK) for t in (*flats, out.view(-1))]
        for p, g, m, v, o in zip(*blocks):
            kernel([p], [g], [m], [v], [], steps, **options)
            o.copy_(p)


@contextlib.contextmanager
def _intra_op_threads(threads: int | None) -> Iterator[None]:
    """Run the body under `threads` intra-op threads, restoring torch's setting afterwards."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _check_tensors(param, grad, exp_avg, exp_avg_sq, out) -> int:
    numel = param.numel()
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32:
            raise AdamInputError(f"{name} is {t.dtype}: CPU-Adam steps fp32 tensors")
        _check_layout(name, t, numel)
    if out is not None:
        if out.dtype not in OUT_DTYPES:
            raise AdamInputError(f"out is {out.dtype}: the copy-out writes one of {OUT_DTYPES}")
        _check_layout("out", out, numel)
    return numel


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
    threads: int | None,
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
        ("grad_scale", grad_scale, lambda x: 0 < x and 1 / x <= _FP32_MAX, f"> 0, with 1/grad_scale <= {_FP32_MAX:.3g}"),
    ):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and ok(value)):
            raise AdamInputError(f"{name} = {value!r}: a finite number {expected}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise AdamInputError(f"threads = {threads!r}: an int >= 1, or None for torch's intra-op setting")
