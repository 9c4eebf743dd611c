"""Our C kernel (zero/optim/adam_kernel.c) against torch's fused kernel, bit for bit: every option that changes the
arithmetic, on every loop this CPU runs (avx512, avx2, scalar), at sizes around the vector widths and the
tail torch rounds its own way, through AdamThreads on 1 and 2 threads and on torch's OpenMP team; a flat buffer of
several parameters, cut anywhere, as torch steps each parameter. The copy-out equals
`param.to(dtype)` for NaNs, infinities, subnormals, ties and overflow; the fallback to torch's kernel gives
the same bits; the probe turns down a kernel that differs. Compared in bits, so NaNs compare too.
"""
from __future__ import annotations

import ctypes
import itertools
import math
import sys

import pytest
import torch

import zero
from zero.optim import adam_math
from zero.optim.adam_math import AdamThreads, adam_step

kernel = pytest.importorskip("zero.optim._adam_kernel", reason="the C kernel is not built (pip install -e .)")

OPTIONS = list(itertools.product(
    (True, False),  # decoupled: AdamW, Adam
    (0.0, 0.01),  # weight_decay
    ((0.9, 0.999), (0.3, 0.95)),  # betas: 1 - beta1 below and above 0.5 take torch's two lerp formulas
    (1e-8, 1e-6),  # eps
    (1.0, 0.37),  # grad_scale
))
OUT_KINDS = {None: 0, torch.bfloat16: 1, torch.float16: 2}


def hyper_of(decoupled, weight_decay, betas, eps, grad_scale, step=1, lr=1e-2):
    return dict(step=step, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay,
                decoupled=decoupled, grad_scale=grad_scale)


def twins(numel: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """param, grad, exp_avg, exp_avg_sq twice; the moments start non-zero, so both exp_avg_sq roundings show."""
    gen = torch.Generator().manual_seed(seed)
    ours = [torch.randn(numel, generator=gen) * 3, torch.empty(numel), torch.randn(numel, generator=gen) * 0.1,
            torch.rand(numel, generator=gen) * 0.01]
    return ours, [t.clone() for t in ours]


def new_grad(ours, theirs, gen) -> None:
    """The same fresh gradient in both, its magnitudes spread from 1e-6 to 1e2."""
    numel = ours[1].numel()
    grad = torch.randn(numel, generator=gen) * 10.0 ** torch.randint(-6, 3, (numel,), generator=gen)
    ours[1].copy_(grad)
    theirs[1].copy_(grad)


def kernel_step(tensors, out, hyper, path=None) -> None:
    p, g, m, v = tensors
    kernel.step(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 0 if out is None else out.data_ptr(),
                OUT_KINDS[None if out is None else out.dtype], p.numel(), **hyper, **({"path": path} if path else {}))


def torch_step(tensors, hyper) -> None:
    fused = torch._fused_adamw_ if hyper["decoupled"] else torch._fused_adam_
    scale = hyper["grad_scale"]
    fused(*([t] for t in tensors), [], [torch.tensor(float(hyper["step"]))], lr=hyper["lr"], beta1=hyper["beta1"],
          beta2=hyper["beta2"], weight_decay=hyper["weight_decay"], eps=hyper["eps"], amsgrad=False, maximize=False,
          grad_scale=None if scale == 1.0 else torch.tensor(1.0 / scale, dtype=torch.float32))


def assert_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    size = actual.element_size()
    a, b = actual.view(torch.uint8).view(-1, size), expected.view(torch.uint8).view(-1, size)
    differ = (a != b).any(dim=1).nonzero().view(-1)
    assert differ.numel() == 0, (f"{what}: {differ.numel()} of {actual.numel()} elements differ, first at "
                                 f"{differ[0].item()}: {actual[differ[0]].item()!r} vs {expected[differ[0]].item()!r}")


def assert_step_equal(ours, theirs, out, what) -> None:
    for name, a, b in zip(("param", "grad", "exp_avg", "exp_avg_sq"), ours, theirs):
        assert_bits(a, b, f"{what}: {name}")
    if out is not None:
        assert_bits(out, theirs[0].to(out.dtype), f"{what}: out")


@pytest.mark.parametrize("numel", [1, 15, 16, 17, 1003])
@pytest.mark.parametrize("path", kernel.paths)
def test_every_option_is_torchs_fused_step_bit_for_bit(path, numel):
    """Three steps per option set, the copy-out dtype cycling with them, in turn aligned (streamed) and not;
    1003 = 62 * 16 + 8 + 3: the 16-wide loop, the 8-wide remainder and torch's 3-element tail."""
    gen = torch.Generator().manual_seed(numel)
    for i, options in enumerate(OPTIONS):
        out_dtype = (None, torch.bfloat16, torch.float16)[i % 3]
        ours, theirs = twins(numel, seed=i)
        out = torch.empty(numel + 1, dtype=out_dtype)[i // 3 % 2:][:numel] if out_dtype else None
        for step in range(1, 4):
            hyper = hyper_of(*options, step=step)
            new_grad(ours, theirs, gen)
            kernel_step(ours, out, hyper, path)
            torch_step(theirs, hyper)
        assert_step_equal(ours, theirs, out, f"{path}, {numel} elements, {hyper}, out {out_dtype}")


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16], ids=["no-out", "bf16", "fp16"])
def test_threads_over_blocks_step_as_one_torch_call(monkeypatch, out_dtype, count):
    """1000003 elements in 62 blocks of 16K (and a ragged last) on our threads: one torch call's bits."""
    monkeypatch.setattr(adam_math, "BLOCK", 1 << 14)
    gen = torch.Generator().manual_seed(0)
    ours, theirs = twins(1_000_003, seed=1)
    out = torch.empty(1_000_003, dtype=out_dtype) if out_dtype else None
    with AdamThreads(count) as threads:
        for step, options in enumerate([OPTIONS[0], OPTIONS[-1]], start=1):
            hyper = hyper_of(*options, step=step)
            new_grad(ours, theirs, gen)
            threads.run(adam_math.adam_blocks(*ours, **hyper, out=out))
            torch_step(theirs, hyper)
    assert_step_equal(ours, theirs, out, f"{count} threads")


@pytest.mark.skipif(not kernel.team, reason="torch's OpenMP runtime (libgomp) was not found")
@pytest.mark.parametrize("numel", [127, 128, 129, 1000, 1_000_003])
@pytest.mark.parametrize("count", [2, 3])
def test_a_step_on_torchs_openmp_team_is_one_torch_call(numel, count):
    """adam_step with several threads: one kernel call split over torch's OpenMP team in runs aligned to 64
    elements, the last member taking torch's tail; below 64 elements per member it runs on one thread."""
    gen = torch.Generator().manual_seed(numel)
    for i, options in enumerate(OPTIONS[::5]):
        out_dtype = (None, torch.bfloat16, torch.float16)[i % 3]
        ours, theirs = twins(numel, seed=i)
        out = torch.empty(numel, dtype=out_dtype) if out_dtype else None
        with AdamThreads(count) as threads:
            for step in (1, 2):
                hyper = hyper_of(*options, step=step)
                new_grad(ours, theirs, gen)
                adam_step(*ours, **hyper, out=out, threads=threads)
                torch_step(theirs, hyper)
        assert_step_equal(ours, theirs, out, f"{count} threads, {numel} elements, {hyper}")


@pytest.mark.skipif(not kernel.team, reason="torch's OpenMP runtime (libgomp) was not found")
@pytest.mark.parametrize("numel", [64 * 16 + 8, 16392])
def test_a_team_of_16_steps_every_element(numel):
    """16 members over a body whose 16th part rounds down to a multiple of 64: the shares still cover all of
    it (rounded down, the last 8 elements were left unstepped)."""
    gen = torch.Generator().manual_seed(numel)
    ours, theirs = twins(numel, seed=numel)
    new_grad(ours, theirs, gen)
    hyper = hyper_of(*OPTIONS[0], step=1)
    kernel.step(*(t.data_ptr() for t in ours), 0, 0, numel, **hyper, threads=16)
    torch_step(theirs, hyper)
    assert_step_equal(ours, theirs, None, f"16 threads, {numel} elements")


EXTENTS = [(0, 15), (15, 3), (18, 21), (39, 7), (46, 1000), (1046, 5)]
"""Parameters in a flat buffer of 1051 elements, all but one of sizes no multiple of 8."""


@pytest.mark.parametrize("chunk", [13, 8, 300, 1051])
@pytest.mark.parametrize("how", ["kernel", "team", "blocks", "fallback", "no-threads"])
def test_a_flat_buffer_of_params_steps_as_torch_steps_each(monkeypatch, how, chunk):
    """Slices of `chunk` elements of a flat buffer of parameters, each stepped with its `param_tails`: torch's
    tail rounding on each parameter's last numel % 8 elements, wherever the slices are cut, and nowhere else."""
    if how == "fallback":
        monkeypatch.setattr(adam_math, "_kernel", lambda: (None, "torch's fused kernel: forced by a test"))
    if how == "blocks":
        monkeypatch.setattr(adam_math, "BLOCK", 16)
    gen = torch.Generator().manual_seed(chunk)
    ours, theirs = twins(1051, seed=chunk)
    with AdamThreads(3 if how == "team" else 1) as threads:
        for step, options in enumerate([OPTIONS[1], OPTIONS[-2]], start=1):  # AdamW scaled, Adam with decay
            hyper = hyper_of(*options, step=step)
            new_grad(ours, theirs, gen)
            for start in range(0, 1051, chunk):
                n = min(chunk, 1051 - start)
                adam_step(*(t[start:start + n] for t in ours), **hyper, tails=adam_math.param_tails(EXTENTS, start, n),
                          threads=None if how == "no-threads" else threads)
            for offset, n in EXTENTS:
                torch_step([t[offset:offset + n] for t in theirs], hyper)
    assert_step_equal(ours, theirs, None, f"{how}, slices of {chunk}")


def test_bad_tails_raise_with_their_values():
    t = torch.zeros(20)
    hyper = hyper_of(True, 0.0, (0.9, 0.999), 1e-8, 1.0)
    for tails in [[(3, 11)], [(5, 7), (4, 6)], [(18, 21)], [(2, 2)]]:
        with pytest.raises(adam_math.AdamInputError, match=r"tails: \(\d+, \d+\)"):
            adam_step(t, t.clone(), t.clone(), t.clone(), **hyper, tails=tails)
    with pytest.raises(ValueError, match="tail 1 is \\(4, 6\\)"):
        kernel.step(*[t.data_ptr()] * 4, 0, 0, 20, **hyper, tails=((5, 7), (4, 6)))


def special_values() -> torch.Tensor:
    bits = torch.tensor([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA00000, 0xFFFFFFFF, 0x00000001, 0x80000001],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)  # NaNs with payloads, fp32 subnormals
    values = [math.inf, -math.inf, 0.0, -0.0, 3.4028235e38, -3.4028235e38, 65504.0, 65519.0, 65520.0, -65520.0,
              6e-8, 3e-8, 2.9e-8, 6.1e-5, 6.0e-5, 1e-40, 1.00390625, 1.01171875, -1.00390625, 1 + 2 ** -11,
              1 + 3 * 2 ** -11, 2.0 ** -24, 1.5 * 2 ** -24]  # fp16 edges and subnormals; bf16 and fp16 ties
    return torch.cat([bits, torch.tensor(values)])


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", kernel.paths)
def test_copy_out_rounds_as_torch_for_special_values(path, out_dtype):
    """lr 0 leaves the params as they are (but for signalling NaNs quieted and some zeros' signs, as in
    torch's step): the copy-out of each special value, in the vector loops and the tails, against
    `param.to(dtype)`, the params against torch's step."""
    values = special_values()
    numel = 3 * values.numel() + 5
    ours, theirs = twins(numel, seed=0)
    for t in (ours[0], theirs[0]):
        t.copy_(values.repeat(4)[:numel])
    out = torch.empty(numel, dtype=out_dtype)
    hyper = hyper_of(True, 0.0, (0.9, 0.999), 1e-8, 1.0, lr=0.0)
    ours[1].zero_()
    theirs[1].zero_()
    kernel_step(ours, out, hyper, path)
    torch_step(theirs, hyper)
    assert_step_equal(ours, theirs, out, f"{path}, lr 0")


def test_fallback_to_torchs_kernel_gives_the_same_bits(monkeypatch):
    """Where the kernel is missing or turned down, our threads run torch's fused kernel: the same result."""
    gen = torch.Generator().manual_seed(0)
    ours, theirs = twins(5003, seed=2)
    outs = [torch.empty(5003, dtype=torch.float16) for _ in range(2)]
    with AdamThreads(2) as threads:
        for step, options in enumerate(OPTIONS[:4], start=1):
            hyper = hyper_of(*options, step=step)
            new_grad(ours, theirs, gen)
            adam_step(*ours, **hyper, out=outs[0], threads=threads)
            with monkeypatch.context() as patch:
                patch.setattr(adam_math, "_kernel", lambda: (None, "torch's fused kernel: forced by a test"))
                adam_step(*theirs, **hyper, out=outs[1], threads=threads)
    assert_step_equal(ours, theirs, outs[0], "kernel vs fallback")
    assert_bits(outs[0], outs[1], "copy-out")


def test_probe_turns_down_a_kernel_that_differs_and_reports_the_choice(monkeypatch):
    class FlipLastBit:
        """The real kernel, then the last bit of the first exp_avg_sq element flipped."""
        paths = kernel.paths

        @staticmethod
        def step(p, g, m, v, *args, **kwargs):
            kernel.step(p, g, m, v, *args, **kwargs)
            ctypes.c_uint32.from_address(v).value ^= 1

    assert adam_math._probe(kernel) is None
    assert adam_math.kernel_choice() == f"the C kernel ({kernel.paths[0]} loop)"
    differs = adam_math._probe(FlipLastBit())
    assert differs is not None and differs.startswith("exp_avg_sq differs")
    monkeypatch.delattr(zero.optim, "_adam_kernel")
    monkeypatch.setitem(sys.modules, "zero.optim._adam_kernel", None)  # the import now raises ImportError
    choice, note = adam_math._kernel.__wrapped__()
    assert choice is None and note.startswith("torch's fused kernel: zero.optim._adam_kernel is not built")


def test_bad_arguments_raise_with_their_values():
    p = torch.zeros(4)
    args = [p.data_ptr()] * 4 + [0, 0, 4]
    hyper = hyper_of(True, 0.0, (0.9, 0.999), 1e-8, 1.0)
    with pytest.raises(ValueError, match="out_kind 3"):
        kernel.step(*args[:5], 3, 4, **hyper)
    with pytest.raises(ValueError, match="step 0"):
        kernel.step(*args, **{**hyper, "step": 0})
    with pytest.raises(ValueError, match="grad_scale -1"):
        kernel.step(*args, **{**hyper, "grad_scale": -1.0})
    with pytest.raises(ValueError, match="null address for 4 elements"):
        kernel.step(*args[:5], 1, 4, **hyper)
    with pytest.raises(ValueError, match="path mmx does not run"):
        kernel.step(*args, **hyper, path="mmx")
