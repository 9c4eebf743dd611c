"""The Adam step of a sub-group stored in a compact state format (state_format.py): decode, torch's fused Adam(W)
arithmetic, encode (stochastic rounding for a bf16-sr master, the compensation for a bf16-kahan one), and the
compute-dtype copy-out, in one pass.

The C kernel (`compact_step` in zero.optim._adam_kernel) runs it block by block in registers, its Adam arithmetic
the exact kernel's (bit for bit torch's fused kernel); `torch_compact_step` computes the same bits with torch ops
a chunk at a time. It runs where the kernel is not built, and the tests compare the two for every format.

Stochastic rounding adds 16 random bits below a value's bf16 part and truncates: unbiased, so updates smaller
than a bf16 step survive on average. The bits are a hash of (step, unit, the element's index in the unit's flat
buffer): a run reproduces, and a roll back's re-step, a resume, and 1 or 2 ranks (the same element keeps its
index whoever holds it) round alike.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .adam_math import AdamThreads, _kernel, _torch_tails, _within
from .state_format import FP32, Kahan, SubGroupCodecs

CHUNK = 1 << 16
"""Elements per torch piece (a multiple of QBLOCK)."""
PIECE = 1 << 20
"""Elements per C kernel call handed to a thread (a multiple of QBLOCK)."""

_MASK32 = 0xFFFFFFFF


def _mix(x):
    """A 32-bit integer hash (Chris Wellons' lowbias32) of an int or an int64 tensor of values below 2^32;
    multiplications split in 16-bit halves, so int64 tensors never overflow."""
    def mul(a, c):
        return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & _MASK32
    x = x ^ (x >> 16)
    x = mul(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul(x, 0x846CA68B)
    return x ^ (x >> 16)


def sr_key(step: int, unit: int) -> int:
    """The stochastic rounding key of `unit` at `step`."""
    return _mix(_mix(unit & _MASK32) ^ (step & _MASK32))


def round_stochastic(values: torch.Tensor, out: torch.Tensor, key: int, index: int) -> None:
    """fp32 `values` into bf16 `out`, rounded stochastically with the bits of elements index, index + 1, ...
    (non-finite values round to nearest)."""
    n = values.numel()
    position = torch.arange(index, index + n, dtype=torch.int64, device=values.device) & _MASK32
    random = _mix(position ^ key) >> 16
    bits = values.view(torch.int32).to(torch.int64) & _MASK32
    rounded = ((bits + random) >> 16) & 0xFFFF
    rounded = torch.where(rounded >= 0x8000, rounded - 0x10000, rounded).to(torch.int16)
    nearest = values.to(torch.bfloat16).view(torch.int16)
    out.view(torch.int16).copy_(torch.where(torch.isfinite(values), rounded, nearest))


def compact_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                 codecs: SubGroupCodecs, numel: int, out: torch.Tensor | None, key: int, index: int,
                 threads: AdamThreads | None, hyper: dict, compensation: torch.Tensor | None = None,
                 tails: tuple[tuple[int, int], ...] | None = None) -> None:
    """One Adam(W) step of a sub-group of `numel` elements whose parts are stored as `codecs` says (`master`,
    `exp_avg`, `exp_avg_sq`: its segments' views; `grad` fp32, or bf16 where hyper's grad_scale is 1: read as
    fp32, with no fp32 copy made; `compensation`: a bf16-kahan master's), with
    `hyper` as `adam_step` takes it. `out` (a bf16/fp16 tensor, or None) receives the stored weights in the compute
    dtype. `key` and `index` (the first element's index in its unit): the stochastic rounding's bits. `tails`: as
    `adam_step`'s (each parameter's last numel % 8 elements; None: the sub-group's), so that the bits do not depend
    on where sub-groups cut the unit. On the C kernel where it is built, on `threads` (None: the calling thread);
    else, and for state kept on a GPU (offload_optimizer none), `torch_compact_step`."""
    if grad.dtype not in (torch.float32, torch.bfloat16) or (grad.dtype == torch.bfloat16 and hyper["grad_scale"] != 1):
        raise ValueError(f"compact_step: a {grad.dtype} gradient with grad_scale {hyper['grad_scale']} (fp32, or bf16 "
                         "at grad_scale 1: a scaled gradient is stored back in fp32)")
    kernel = _kernel()[0]
    parts = runs(master, grad, exp_avg, exp_avg_sq, out, compensation, codecs, numel)
    tails = ((numel - numel % 8, numel),) if tails is None else tails
    if kernel is None or not hasattr(kernel, "compact_step") or master.device.type != "cpu":
        for args, run_codecs, n, at in parts:
            torch_compact_step(*args, codecs=run_codecs, numel=n, key=key, index=index + at, hyper=hyper,
                               tails=_within(tails, at, n))
        return
    pieces = [piece for args, run_codecs, n, at in parts
              for piece in kernel_pieces(kernel, *args, codecs=run_codecs, numel=n, key=key, index=index + at,
                                         hyper=hyper, tails=_within(tails, at, n))]
    if threads is None:
        for piece in pieces:
            piece()
    else:
        threads.run(pieces)


def compact_choice() -> str:
    """Which implementation `compact_step` runs here: the C kernel (and the way its int8 codecs run), or
    `torch_compact_step` where the kernel is not built (the same bits, tens of times slower)."""
    kernel = _kernel()[0]
    if kernel is None or not hasattr(kernel, "compact_step"):
        return "torch_compact_step (pure torch: the C kernel is not built or not used here)"
    return f"the C kernel (int8 codecs: {kernel.int8_path()})"


def int8_paths() -> list[str]:
    """The ways the C kernel can run the int8 codecs on this CPU (compact_kernel.c: AVX-512 with VBMI or AVX2, each
    reading tables with gathers or with scalar loads, and scalar); [] where the kernel is not built."""
    kernel = _kernel()[0]
    return kernel.int8_paths() if kernel is not None and hasattr(kernel, "int8_paths") else []


def int8_path(name: str | None = None) -> str:
    """The way the kernel runs the int8 codecs (chosen at import); `name`, one of int8_paths(), sets it (the same
    bits either way: bench/adam.py measures them side by side)."""
    kernel = _kernel()[0]
    if kernel is None or not hasattr(kernel, "int8_path"):
        raise RuntimeError("the C kernel is not built here: the int8 codecs run torch_compact_step")
    return kernel.int8_path(*(() if name is None else (name,)))


def runs(master, grad, exp_avg, exp_avg_sq, out, compensation, codecs: SubGroupCodecs, numel: int):
    """((master, grad, exp_avg, exp_avg_sq, out, compensation), codecs, numel, start) of each run of the sub-group
    stored in one codec per part (SubGroupCodecs.runs): the views a step of that run takes."""
    for start, n, run_codecs, m_tile, v_tile in codecs.runs(numel):
        yield ((master.narrow(0, start, n), grad.narrow(0, start, n),
                exp_avg if m_tile is None else m_tile.view(exp_avg),
                exp_avg_sq if v_tile is None else v_tile.view(exp_avg_sq),
                None if out is None else out.narrow(0, start, n),
                None if compensation is None else compensation.narrow(0, start, n)), run_codecs, n, start)


def kernel_pieces(kernel, master, grad, exp_avg, exp_avg_sq, out: torch.Tensor | None,
                  compensation: torch.Tensor | None = None, *, codecs: SubGroupCodecs, numel: int, key: int, index: int,
                  hyper: dict, tails: tuple[tuple[int, int], ...] | None = None) -> list[Callable[[], None]]:
    """The C kernel's calls for the step, one per PIECE elements, to run on any threads in any order (`tails`
    None: the run's last numel % 8 elements)."""
    maps = _maps()
    call = functools.partial(
        kernel.compact_step, master.data_ptr(), codecs.master.kind, grad.data_ptr(), exp_avg.data_ptr(),
        codecs.exp_avg.kind, exp_avg_sq.data_ptr(), codecs.exp_avg_sq.kind, 0 if out is None else out.data_ptr(),
        0 if out is None else (1 if out.dtype == torch.bfloat16 else 2), numel, int(codecs.stochastic), key, index,
        *(t.data_ptr() for t in maps), compensation=0 if compensation is None else compensation.data_ptr(),
        grad_kind=int(grad.dtype == torch.bfloat16), tails=tails, **hyper)
    return [functools.partial(call, lo, min(lo + PIECE, numel)) for lo in range(0, numel, PIECE)]


@functools.cache
def _maps() -> tuple[torch.Tensor, ...]:
    from .state_format import INT8_SIGNED, INT8_UNSIGNED
    return tuple(getattr(codec, name) for codec in (INT8_SIGNED, INT8_UNSIGNED)
                 for name in ("values", "planes", "buckets"))


def torch_compact_step(master, grad, exp_avg, exp_avg_sq, out: torch.Tensor | None,
                       compensation: torch.Tensor | None = None, *, codecs: SubGroupCodecs, numel: int, key: int,
                       index: int, hyper: dict, tails: tuple[tuple[int, int], ...] | None = None) -> None:
    """`compact_step` of one run (one codec per part) with torch ops, CHUNK elements at a time (scratch of three
    chunks, fp32); `tails` None: the run's last numel % 8 elements."""
    tails = ((numel - numel % 8, numel),) if tails is None else tails
    scratch = torch.empty(3, min(CHUNK, numel), dtype=torch.float32, device=master.device)
    for lo in range(0, numel, CHUNK):
        n = min(CHUNK, numel - lo)
        fp32 = []
        for k, (stored, codec) in enumerate(((master, codecs.master), (exp_avg, codecs.exp_avg),
                                             (exp_avg_sq, codecs.exp_avg_sq))):
            if codec is FP32:
                fp32.append(stored.narrow(0, lo, n))
            elif k == 0 and codecs.compensated:
                fp32.append(scratch[k, :n])
                Kahan.decode(stored.narrow(0, lo, n), compensation.narrow(0, lo, n), fp32[-1])
            else:
                fp32.append(scratch[k, :n])
                codec.decode(stored, numel, fp32[-1], lo)
        p, m, v = fp32
        # a bf16 grad read as fp32; torch's tail rounding where a parameter ends
        _torch_tails(p, grad.narrow(0, lo, n).float(), m, v, hyper, _within(tails, lo, n))
        for stored, codec, values in ((exp_avg, codecs.exp_avg, m), (exp_avg_sq, codecs.exp_avg_sq, v)):
            if codec is not FP32:
                codec.encode(values, stored, numel, lo)
        if codecs.master is not FP32:
            if codecs.compensated:
                Kahan.encode(p, master.narrow(0, lo, n), compensation.narrow(0, lo, n))
            elif codecs.stochastic:
                round_stochastic(p, master.narrow(0, lo, n), key, index + lo)
            else:
                codecs.master.encode(p, master, numel, lo)
        if out is not None:
            out.narrow(0, lo, n).copy_(p if codecs.master is FP32 else master.narrow(0, lo, n))

