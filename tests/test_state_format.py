"""The compact state formats' codecs and step (zero/optim/state_format.py, compact_step.py, compact_kernel.c):
the block-wise int8 round trip within its bound per block against a float64 reference, decoding and encoding again
the identity (what a checkpoint relies on), the C kernel and the torch version equal bit for bit for every format
(the same random bits for stochastic rounding), stochastic rounding unbiased, the keys of its bits, and the config's
errors; the tiled layout (a codec per tensor) and its step; a unit's bits the same however sub-groups, kernel pieces
and torch chunks cut it, and torch's fused AdamW stepping each parameter; a Kahan master's compensation carrying
what bf16 drops. Compared in bits."""
from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero.config import ConfigError, load_config
from zero.optim.adam_math import _kernel
from zero.optim import compact_step as compact_step_module
from zero.optim.compact_step import compact_step, kernel_pieces, round_stochastic, sr_key, torch_compact_step
from zero.optim.driver import AdamDriver
from zero.optim.state_format import (
    BF16, FP32, INT8_SIGNED, INT8_UNSIGNED, QBLOCK, SMALLEST_INT8, Kahan, StateFormat, Tiled, dynamic_map, int8_runs,
)

from conftest import PAGE

HYPER = dict(step=3, lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=True, grad_scale=0.37)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def encoded(codec, values: torch.Tensor) -> torch.Tensor:
    stored = torch.zeros(codec.storage_numel(values.numel()), dtype=codec.dtype)
    codec.encode(values, stored, values.numel())
    return stored


def decoded(codec, stored: torch.Tensor, numel: int) -> torch.Tensor:
    out = torch.empty(numel, dtype=torch.float32)
    codec.decode(stored, numel, out)
    return out


@settings(max_examples=40, deadline=None)
@given(numel=st.integers(1, 3 * QBLOCK + 17), signed=st.booleans(), scale=st.sampled_from([1e-20, 1e-6, 1.0, 1e6]),
       seed=st.integers(0, 2**16))
def test_int8_round_trip_within_the_map_s_bound(numel, signed, scale, seed):
    """Each element decodes to the code nearest its value / absmax: the error is at most half the gap between the
    two codes around it, times the absmax (float64 arithmetic, a relative slack of 1e-6 for the fp32 steps); an
    unsigned value below the first non-zero code rounds up to it, within the whole gap."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=gen) * scale
    if not signed:
        values = values.abs()
    codec = INT8_SIGNED if signed else INT8_UNSIGNED
    out = decoded(codec, encoded(codec, values), numel).double()
    table = dynamic_map(signed)[0].double()
    for block in range(codec.blocks(numel)):
        piece = slice(block * QBLOCK, min(numel, (block + 1) * QBLOCK))
        x = values[piece].double()
        absmax = x.abs().max()
        y = x / absmax
        upper = torch.searchsorted(table, y.clamp(table[0], table[-1])).clamp(1, 255)
        gap = table[upper] - table[upper - 1]
        gap = torch.where(upper == 1, 2 * gap, gap) if not signed else gap  # below the first code: rounded up
        bound = gap / 2 * absmax * (1 + 1e-6) + 1e-45
        assert ((out[piece] - x).abs() <= bound).all(), (block, (out[piece] - x).abs().max().item())


@pytest.mark.parametrize("codec", [BF16, INT8_SIGNED, INT8_UNSIGNED], ids=["bf16", "int8s", "int8u"])
def test_decode_then_encode_is_the_identity(codec):
    """A checkpoint stores decoded fp32 values; loading encodes them again: the same bytes, tiny blocks included."""
    gen = torch.Generator().manual_seed(0)
    numel = 5 * QBLOCK + 3
    values = torch.randn(numel, generator=gen) * 10.0 ** torch.randint(-40, 5, (numel,), generator=gen)
    values[:QBLOCK] *= 1e-30  # a block below the tiny threshold: stored as zeros
    values[QBLOCK:2 * QBLOCK] = 0
    if codec is INT8_UNSIGNED:
        values = values.abs()
    stored = encoded(codec, values)
    assert torch.equal(bits(encoded(codec, decoded(codec, stored, numel))), bits(stored))


def test_int8_maps_are_256_sorted_codes_with_zero_and_one():
    for signed in (True, False):
        table, midpoints = dynamic_map(signed)
        assert table.numel() == 256 and midpoints.numel() == 255
        assert (table[1:] > table[:-1]).all()
        assert 0.0 in table.tolist() and table[-1] == 1.0 and (table[0] == -1.0) == signed


kernel = _kernel()[0]
needs_kernel = pytest.mark.skipif(kernel is None or not hasattr(kernel, "compact_step"),
                                  reason="the C kernel is not built (pip install -e .)")


def sub_group(codecs, numel: int, seed: int, out_dtype):
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(numel, generator=gen) * 3, torch.randn(numel, generator=gen) * 0.1,
              torch.rand(numel, generator=gen) * 0.01]
    grad = torch.randn(numel, generator=gen) * 10.0 ** torch.randint(-6, 3, (numel,), generator=gen)
    stored = [encoded(codec, x) for codec, x in zip((codecs.master, codecs.exp_avg, codecs.exp_avg_sq), values)]
    out = None if out_dtype is None else torch.zeros(numel, dtype=out_dtype)
    compensation = None
    if codecs.compensated:
        compensation = torch.empty(numel, dtype=Kahan.dtype)
        Kahan.encode(values[0], stored[0], compensation)
    return [stored[0], grad, stored[1], stored[2]], out, compensation


def int8_paths() -> list[str | None]:
    """Every way this CPU runs the kernel's int8 codecs (compact_kernel.c picks one at import, so the others would
    otherwise never run): the widths it has, each with gathers and with scalar loads, and the scalar loops."""
    return [None] if kernel is None else kernel.int8_paths()


@contextlib.contextmanager
def int8_path(name: str | None):
    before = kernel.int8_path()
    if name is not None:
        kernel.int8_path(name)
    try:
        yield
    finally:
        if name is not None:
            kernel.int8_path(before)


FORMATS = [StateFormat(moments, master) for moments, master in itertools.product(
    ("fp32", "bf16", "int8"), ("fp32", "bf16", "bf16-sr", "bf16-kahan"))]


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.moments}-{f.master}")
@pytest.mark.parametrize("numel", [SMALLEST_INT8 + 3 * QBLOCK + 5, 70001])
@pytest.mark.parametrize("ends", [False, True], ids=["one-tensor", "parameter-ends"])
def test_kernel_equals_torch_bit_for_bit(fmt, numel, ends):
    """Every part, the scaled gradient and the copy-out; sizes with a partial last block and a scalar tail, and
    more than one kernel piece and torch chunk; int8 moments with both ways of reading the tables; `ends`: the
    sub-group holds several parameters, whose last numel % 8 elements (`tails`) round as torch's scalar loop."""
    tails = ((13, 17), (1001, 1004), (numel - 5, numel)) if ends else None
    codecs = fmt.codecs(numel)
    for path, out_dtype, hyper in itertools.product(int8_paths() if fmt.moments == "int8" else [None],
                                                   (None, torch.bfloat16, torch.float16),
                                                   (HYPER, {**HYPER, "decoupled": False, "grad_scale": 1.0})):
        if fmt.master != "fp32" and out_dtype is torch.float16:
            continue
        theirs, their_out, their_comp = sub_group(codecs, numel, 7, out_dtype)
        ours, our_out, our_comp = sub_group(codecs, numel, 7, out_dtype)
        torch_compact_step(*theirs, codecs=codecs, numel=numel, out=their_out, compensation=their_comp,
                           key=sr_key(5, 2), index=1000, hyper=hyper, tails=tails)
        with int8_path(path):
            for piece in kernel_pieces(kernel, *ours, codecs=codecs, numel=numel, out=our_out, compensation=our_comp,
                                       key=sr_key(5, 2), index=1000, hyper=hyper, tails=tails):
                piece()
        for name, a, b in zip(("master", "grad", "exp_avg", "exp_avg_sq", "out", "compensation"),
                              ours + [our_out, our_comp], theirs + [their_out, their_comp]):
            if a is not None:
                assert torch.equal(bits(a), bits(b)), (name, path, out_dtype, hyper)


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.moments}-{f.master}")
def test_a_bf16_gradient_steps_as_its_fp32_value(fmt):
    """bf16 compute without a loss scale: the step reads the bf16 gradient as fp32 itself (no fp32 copy made), the
    same bits as its fp32 value stepped, on the kernel and in torch; with a loss scale (a scaled gradient is stored
    back, in fp32) a bf16 gradient is refused."""
    numel = SMALLEST_INT8 + 3 * QBLOCK + 5
    codecs = fmt.codecs(numel)
    hyper = {**HYPER, "grad_scale": 1.0}
    for path in int8_paths() if fmt.moments == "int8" else [None]:
        stepped = []
        for grad_dtype, on_kernel in itertools.product((torch.float32, torch.bfloat16), (False, True)):
            parts, out, comp = sub_group(codecs, numel, 11, torch.bfloat16 if fmt.master != "fp32" else None)
            parts[1] = parts[1].to(torch.bfloat16).to(grad_dtype)  # the same values either way
            args = dict(codecs=codecs, numel=numel, out=out, compensation=comp, key=sr_key(5, 2), index=1000,
                        hyper=hyper)
            if on_kernel:
                with int8_path(path):
                    for piece in kernel_pieces(kernel, *parts, **args):
                        piece()
            else:
                torch_compact_step(*parts, **args)
            stepped.append([bits(t) for t in parts[:1] + parts[2:] + [x for x in (out, comp) if x is not None]])
        for other in stepped[1:]:
            assert all(torch.equal(a, b) for a, b in zip(stepped[0], other)), (fmt, path)
    parts, out, comp = sub_group(codecs, numel, 11, None)
    with pytest.raises(ValueError, match="grad_scale"):
        compact_step(parts[0], parts[1].bfloat16(), *parts[2:], codecs=codecs, numel=numel, out=None, key=0, index=0,
                     threads=None, hyper=HYPER, compensation=comp)


def beside(values: torch.Tensor) -> torch.Tensor:
    """Each value, and the floats one and two ulps either side of it."""
    out = [values]
    for direction in (torch.inf, -torch.inf):
        step = values
        for _ in range(2):
            step = torch.nextafter(step, torch.full_like(step, direction))
            out.append(step)
    return torch.cat(out)


def blocks_led_by_one(values: torch.Tensor) -> torch.Tensor:
    """`values` (|x| <= 1) in blocks whose first element is 1.0: each block's absmax is 1, so it encodes x / 1."""
    rows = values.split(QBLOCK - 1)
    return torch.cat([torch.cat([torch.ones(1), row]) for row in rows])


@needs_kernel
@pytest.mark.parametrize("path", int8_paths())
def test_the_kernel_picks_the_nearest_code_at_and_beside_every_midpoint(path):
    """The kernel's one-read bucket search (state_format.buckets) against torch's searchsorted, for every midpoint
    of both maps and the floats beside it. With beta1 and beta2 0 the step's moments are the gradient and its
    square, encoded; the gradient holds the signed map's midpoints and the roots of the unsigned map's (the square
    of a root and of its neighbours lands on both sides of the midpoint), in blocks led by 1.0 (absmax 1)."""
    signed = beside(dynamic_map(True)[1])
    roots = beside(beside(dynamic_map(False)[1]).sqrt())
    grad = blocks_led_by_one(torch.cat([signed, roots, -roots]).clamp(-1, 1))
    numel = grad.numel()
    codecs = StateFormat("int8", "fp32").codecs(numel)
    hyper = dict(HYPER, beta1=0.0, beta2=0.0, weight_decay=0.0, grad_scale=1.0)
    moments = []
    for on_kernel in (False, True):
        state = [torch.zeros(numel), grad.clone(), encoded(codecs.exp_avg, torch.zeros(numel)),
                 encoded(codecs.exp_avg_sq, torch.zeros(numel))]
        args = dict(codecs=codecs, numel=numel, key=0, index=0, hyper=hyper)
        if on_kernel:
            with int8_path(path):
                for piece in kernel_pieces(kernel, *state, None, **args):
                    piece()
        else:
            torch_compact_step(*state, None, **args)
        moments.append(state[2:])
    torch_codes, kernel_codes = moments
    # the premise: the moments encoded are the gradient and its square
    assert torch.equal(torch_codes[0], encoded(codecs.exp_avg, grad))
    assert torch.equal(torch_codes[1], encoded(codecs.exp_avg_sq, grad * grad))
    for theirs, ours in zip(torch_codes, kernel_codes):
        assert torch.equal(ours, theirs)


TINY_SQUARES = torch.logspace(-38, -6, 16 * (QBLOCK - 1), dtype=torch.float64).float()
"""Second moments of 1e-38 .. 1e-6 of their block's absmax: the nearest unsigned code of most of them is 0."""


@pytest.mark.parametrize("path", int8_paths())
def test_a_positive_second_moment_never_encodes_as_zero(path):
    """Codes 0 for a second moment whose first moment is not 0 made a later step with a zero gradient move the
    weight by lr * m / eps: a positive value takes the smallest non-zero code instead, in torch's encode and in the
    kernel's (every path this CPU runs; the step with beta2 0 stores the gradient's square); zero stays 0."""
    values = blocks_led_by_one(torch.cat([TINY_SQUARES, torch.zeros(20)]))  # int8 moments: >= SMALLEST_INT8
    assert (TINY_SQUARES < dynamic_map(False)[1][0]).float().mean() > 0.9  # the premise: most are nearest to 0
    torch_codes = INT8_UNSIGNED.split(encoded(INT8_UNSIGNED, values), values.numel())[1]
    assert torch.equal(torch_codes == 0, values == 0)
    if kernel is None:
        return
    grad, numel = values.sqrt(), values.numel()
    assert torch.equal(grad * grad > 0, values > 0)  # the squares stay positive in fp32
    codecs = StateFormat("int8", "fp32").codecs(numel)
    state = [torch.zeros(numel), grad, encoded(codecs.exp_avg, torch.zeros(numel)),
             encoded(codecs.exp_avg_sq, torch.zeros(numel))]
    hyper = dict(HYPER, beta1=0.0, beta2=0.0, weight_decay=0.0, grad_scale=1.0)
    with int8_path(path):
        for piece in kernel_pieces(kernel, *state, None, codecs=codecs, numel=numel, key=0, index=0, hyper=hyper):
            piece()
    assert torch.equal(decoded(codecs.exp_avg_sq, state[3], numel) == 0, values == 0)
    assert torch.equal(state[3], encoded(codecs.exp_avg_sq, grad * grad))


def test_stochastic_rounding_is_unbiased():
    """The mean of 4096 stochastic roundings (different keys) of values between two bf16 neighbours is within
    4 standard errors of the value; round to nearest is biased by up to half a step."""
    gen = torch.Generator().manual_seed(3)
    values = (1 + torch.rand(64, generator=gen)) * 2.0 ** torch.randint(-20, 20, (64,), generator=gen).float()
    rounds = torch.empty(4096, 64)
    out = torch.empty(64, dtype=torch.bfloat16)
    for k in range(rounds.shape[0]):
        round_stochastic(values, out, sr_key(k, 0), 0)
        rounds[k] = out.float()
    step = values.to(torch.bfloat16).float().abs() * 2.0 ** -7  # a bf16 step at these magnitudes (or half of one)
    error = (rounds.double().mean(0) - values.double()).abs()
    assert (error <= 4 * step.double() / 2 / 64).all(), (error / step).max()
    down = (values.view(torch.int32) & ~0xFFFF).view(torch.float32)  # truncated to bf16, and the next one up
    up = (down.view(torch.int32) + 0x10000).view(torch.float32)
    assert ((rounds == down) | (rounds == up)).all()


def test_stochastic_bits_are_keyed_by_step_unit_and_index():
    """The same (step, unit, index) rounds alike whoever holds the element: a piece from index 100 equals that
    slice of the whole; another step or unit rounds otherwise."""
    gen = torch.Generator().manual_seed(4)
    values = torch.randn(1000, generator=gen)
    whole, piece, other = (torch.empty(n, dtype=torch.bfloat16) for n in (1000, 900, 1000))
    round_stochastic(values, whole, sr_key(7, 3), 0)
    round_stochastic(values[100:], piece, sr_key(7, 3), 100)
    assert torch.equal(bits(piece), bits(whole[100:]))
    for key in (sr_key(8, 3), sr_key(7, 4)):
        round_stochastic(values, other, key, 0)
        assert not torch.equal(bits(other), bits(whole))


def test_small_tensors_keep_fp32_moments():
    fmt = StateFormat("int8", "fp32")
    assert fmt.codecs(SMALLEST_INT8 - 1).exp_avg is FP32
    assert fmt.codecs(SMALLEST_INT8).exp_avg is INT8_SIGNED and fmt.codecs(SMALLEST_INT8).exp_avg_sq is INT8_UNSIGNED
    assert fmt.state_bytes(1 << 20) == 4 * (1 << 20) + 2 * ((1 << 20) + 4 * (1 << 12))
    assert StateFormat().state_bytes(1000, master=False) == 8000
    kahan = StateFormat("fp32", "bf16-kahan")  # its compensation is stored even where the master is the parameter
    assert kahan.state_bytes(1000, master=False) == 8000 + 2000 and kahan.state_bytes(1000) == 2000 + 8000 + 2000
    # a sub-group of small tensors only (norms, biases): fp32, however large the sub-group
    assert fmt.codecs(3 * 4000, 0, [(k * 4000, 4000) for k in range(3)]).exp_avg is FP32
    # one large tensor covering the sub-group, which starts inside it: plain int8
    assert fmt.codecs(5000, 1000, [(0, 100_000)]).exp_avg is INT8_SIGNED


TENSORS = [(0, 100), (100, 5000), (5100, 300), (5400, 9000), (14400, 4096)]
"""A unit's parameters (offset, numel) in its flat buffer: small, large, small, large, large (flat length 18496)."""


def test_int8_runs_follow_the_tensors():
    """A sub-group starting inside the first tensor: small tensors and the padding are fp32 (merged), each large
    tensor's part a quantized run of its own, so that its blocks start at its own first element there."""
    assert int8_runs(19000, 50, TENSORS) == [(0, 50, False), (50, 5000, True), (5050, 300, False),
                                             (5350, 9000, True), (14350, 4096, True), (18446, 554, False)]
    assert int8_runs(3000, 6000, TENSORS) == [(0, 3000, True)]
    assert int8_runs(100, 0, None) == [(0, 100, False)] and int8_runs(4096, 0, None) == [(0, 4096, True)]


def test_tiled_moments_store_each_run_in_its_codec():
    """Each tile starts on a 4-byte boundary, the segment's bytes are the tiles' (padded), and decoding gives each
    tile's own codec's values: the tiled layout is the per-tensor codecs side by side."""
    fmt = StateFormat("int8", "fp32")
    codecs = fmt.codecs(19000, 50, TENSORS)
    assert isinstance(codecs.exp_avg, Tiled) and isinstance(codecs.exp_avg_sq, Tiled)
    tiles = codecs.exp_avg.tiles
    assert [t.codec for t in tiles] == [FP32, INT8_SIGNED, FP32, INT8_SIGNED, INT8_SIGNED, FP32]
    assert all(t.offset % 4 == 0 for t in tiles)
    assert codecs.exp_avg.storage_numel(19000) == sum(-(-t.codec.nbytes(t.numel) // 4) * 4 for t in tiles)
    assert fmt.state_bytes(19000, index=50, extents=TENSORS) == 4 * 19000 + 2 * codecs.exp_avg.storage_numel(19000)
    values = torch.randn(19000, generator=torch.Generator().manual_seed(5))
    stored = encoded(codecs.exp_avg, values)
    out = decoded(codecs.exp_avg, stored, 19000)
    for tile in tiles:
        piece = values.narrow(0, tile.start, tile.numel)
        alone = decoded(tile.codec, encoded(tile.codec, piece), tile.numel)
        assert torch.equal(bits(out.narrow(0, tile.start, tile.numel)), bits(alone))
    assert torch.equal(bits(encoded(codecs.exp_avg, out)), bits(stored))


@needs_kernel
@pytest.mark.parametrize("master", ["fp32", "bf16-sr", "bf16-kahan"])
def test_a_tiled_sub_group_steps_alike_on_the_kernel_and_torch(master, monkeypatch):
    """compact_step over a tiled sub-group: the kernel's pieces and the torch version (no kernel) give the same
    bits, and each tile's step is that of the tile stepped alone at its index (its own stochastic bits)."""
    codecs = StateFormat("int8", master).codecs(19000, 50, TENSORS)
    out_dtype = torch.bfloat16
    ours, our_out, our_comp = sub_group(codecs, 19000, 8, out_dtype)
    theirs, their_out, their_comp = sub_group(codecs, 19000, 8, out_dtype)
    step = dict(codecs=codecs, numel=19000, key=sr_key(4, 1), index=50, threads=None, hyper=HYPER)
    compact_step(*ours, out=our_out, compensation=our_comp, **step)
    alone, _, alone_comp = sub_group(codecs, 19000, 8, out_dtype)
    for args, run_codecs, n, at in compact_step_module.runs(*alone, None, alone_comp, codecs, 19000):
        torch_compact_step(*args, codecs=run_codecs, numel=n, key=sr_key(4, 1), index=50 + at, hyper=HYPER)
    monkeypatch.setattr(compact_step_module, "_kernel", lambda: (None,))
    compact_step(*theirs, out=their_out, compensation=their_comp, **step)
    for name, a, b, c in zip(("master", "grad", "exp_avg", "exp_avg_sq", "out", "compensation"),
                             ours + [our_out, our_comp], theirs + [their_out, their_comp],
                             alone + [None, alone_comp]):
        if a is None:
            continue
        assert torch.equal(bits(a), bits(b)), name
        assert c is None or torch.equal(bits(a), bits(c)), name


UNIT = [(0, 4101), *((4101 + 7 * k, 7) for k in range(150)), (5151, 13), (5164, 45), (5376, 5003), (10379, 5)]
"""A unit's parameters (offset, numel), none a multiple of 8 elements: two large ones (int8 moments), each starting
on a multiple of QBLOCK (padding before the second), small ones between them, 150 of them tails only. torch's two
loops round apart in few elements (v in about 1 in 6, the weights 1 in 400): enough tails for bf16 moments to show
it."""
GROUP = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, decoupled=True)


def unit_values(steps: int = 3) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """UNIT's initial weights and a gradient a step: zero in the padding, as a flat unit's."""
    gen = torch.Generator().manual_seed(3)
    numel = sum(UNIT[-1])
    inside = torch.zeros(numel)
    for offset, size in UNIT:
        inside[offset:offset + size] = 1
    grads = [torch.randn(numel, generator=gen) * 10.0 ** torch.randint(-6, 3, (numel,), generator=gen) * inside
             for _ in range(steps)]
    return torch.randn(numel, generator=gen) * inside, grads


def driven(fmt: StateFormat, chunk: int, make_manager) -> dict[str, torch.Tensor]:
    """UNIT stepped by an AdamDriver in sub-groups of `chunk` elements (0: one): its master and moments
    (decoded, fp32) and its bf16 weights, over the whole unit."""
    master, grads = unit_values()
    weights = torch.zeros(master.numel(), dtype=torch.bfloat16)
    driver = AdamDriver(make_manager(host_budget=1024 * PAGE), state_home="host", grad_home="host",
                        work_tier="host", state_format=fmt)
    try:
        sub_groups = driver.add_unit(0, "u", master, group=0, chunk=chunk, extents=UNIT)
        for step, grad in enumerate(grads, 1):
            for sg in sub_groups:
                driver.accumulate(sg, grad.narrow(0, sg.offset, sg.numel))
            driver.step([GROUP], step, 1.0, None,
                        lambda sg: contextlib.nullcontext(weights.narrow(0, sg.offset, sg.numel)))
        parts = {"weights": weights}
        for part in ("master", "exp_avg", "exp_avg_sq"):
            pieces = []
            for sg in sub_groups:
                with driver.held(sg, part) as values:
                    pieces.append(values.clone())
            parts[part] = torch.cat(pieces)
        return parts
    finally:
        driver.close()


@needs_kernel
@pytest.mark.parametrize("fmt", [f for f in FORMATS if not f.exact], ids=lambda f: f"{f.moments}-{f.master}")
def test_where_sub_groups_pieces_and_chunks_cut_a_unit_changes_no_bit(fmt, make_manager, monkeypatch):
    """torch's fused Adam rounds each parameter's last numel % 8 elements with its scalar loop; the compact step
    does so where each parameter ends (SubGroup.tails), so a unit's bits are the same stepped as one sub-group or
    cut mid-parameter and mid-tail, in kernel pieces or torch chunks (int8 moments: cut on multiples of QBLOCK from a
    large parameter's start, where its blocks start)."""
    whole = driven(fmt, 0, make_manager)
    monkeypatch.setattr(compact_step_module, "PIECE", 2 * QBLOCK)
    monkeypatch.setattr(compact_step_module, "CHUNK", 3 * QBLOCK)
    for on_kernel in (True, False):
        if not on_kernel:
            monkeypatch.setattr(compact_step_module, "_kernel", lambda: (None,))
        for chunk in (3 * QBLOCK, 10 * QBLOCK) if fmt.moments == "int8" else (100, 333, 2560):
            cut = driven(fmt, chunk, make_manager)
            for name in whole:
                assert torch.equal(bits(whole[name]), bits(cut[name])), (name, chunk, on_kernel)


@pytest.mark.parametrize("fmt", [StateFormat(m, master) for m in ("fp32", "bf16", "int8") for master in ("fp32", "bf16")
                                 if (m, master) != ("fp32", "fp32")], ids=lambda f: f"{f.moments}-{f.master}")
def test_a_unit_steps_as_torch_s_fused_adamw_steps_each_parameter(fmt, make_manager):
    """torch.optim.AdamW(fused=True) stepping each of UNIT's parameters, the state decoded before each step and
    encoded after it, gives the compact step's bits."""
    master, grads = unit_values()
    codecs = fmt.codecs(master.numel(), 0, UNIT)
    parts = ("master", "exp_avg", "exp_avg_sq")
    stored = [encoded(codecs.of(part), x) for part, x in zip(parts, (master, torch.zeros_like(master),
                                                                     torch.zeros_like(master)))]
    spans = [slice(offset, offset + size) for offset, size in UNIT]
    params = [torch.nn.Parameter(torch.empty(size)) for _, size in UNIT]
    opt = torch.optim.AdamW(params, lr=GROUP["lr"], betas=GROUP["betas"], eps=GROUP["eps"],
                            weight_decay=GROUP["weight_decay"], fused=True)
    for step, grad in enumerate(grads, 1):
        values = [decoded(codecs.of(part), x, master.numel()) for part, x in zip(parts, stored)]
        for p, at in zip(params, spans):
            p.data.copy_(values[0][at])
            p.grad = grad[at].clone()
            opt.state[p] = {"step": torch.tensor(step - 1.0), "exp_avg": values[1][at].clone(),
                            "exp_avg_sq": values[2][at].clone()}
        opt.step()
        for p, at in zip(params, spans):
            for x, stepped in zip(values, (p.data, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])):
                x[at] = stepped
        stored = [encoded(codecs.of(part), x) for part, x in zip(parts, values)]
    ours = driven(fmt, 0, make_manager)
    for part, x in zip(parts, stored):
        assert torch.equal(bits(ours[part]), bits(decoded(codecs.of(part), x, master.numel()))), part


def test_a_kahan_master_decodes_and_encodes_to_the_same_bytes():
    """Weights to nearest and the remainder truncated: decoding and encoding again gives the same bytes (a
    checkpoint stores decoded values); the pair holds the value to about 16 bits; not finite: no compensation."""
    gen = torch.Generator().manual_seed(9)
    values = torch.randn(10_000, generator=gen) * 10.0 ** torch.randint(-30, 30, (10_000,), generator=gen)
    values[:3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    weights, compensation = torch.empty(10_000, dtype=torch.bfloat16), torch.empty(10_000, dtype=torch.bfloat16)
    Kahan.encode(values, weights, compensation)
    out = torch.empty(10_000)
    Kahan.decode(weights, compensation, out)
    again_w, again_c = torch.empty_like(weights), torch.empty_like(compensation)
    Kahan.encode(out, again_w, again_c)
    assert torch.equal(bits(again_w), bits(weights)) and torch.equal(bits(again_c), bits(compensation))
    assert torch.equal(bits(weights[:3]), bits(values[:3].to(torch.bfloat16))) and (compensation[:3] == 0).all()
    finite = values[3:].double()
    # the weight the nearest bf16, or its neighbour where the pair's sum is a tie
    assert ((weights[3:].double() - finite).abs() <= finite.abs() * 2.0 ** -8).all()
    assert ((out[3:].double() - finite).abs() <= finite.abs() * 2.0 ** -15).all()


@needs_kernel
@pytest.mark.parametrize("on_kernel", [True, False], ids=["kernel", "torch"])
def test_kahan_compensation_carries_what_bf16_drops(on_kernel, monkeypatch):
    """300 Adam steps whose updates (1e-4) are far below half a bf16 step at 1.0 (2^-8): a bf16 master rounded to
    nearest never moves; a Kahan master moves as the fp32 one does, within 2% (each step rounds the compensation,
    whose step near 2^-9 is 2^-17: 300 such roundings are a few 1e-4 at worst)."""
    if not on_kernel:
        monkeypatch.setattr(compact_step_module, "_kernel", lambda: (None,))
    numel = 4096
    hyper = dict(HYPER, lr=1e-4, weight_decay=0.0, grad_scale=1.0)
    finals = {}
    for master in ("fp32", "bf16", "bf16-kahan"):
        codecs = StateFormat("fp32", master).codecs(numel)
        start = torch.ones(numel)
        stored = encoded(codecs.master, start)
        compensation = torch.zeros(numel, dtype=torch.bfloat16) if codecs.compensated else None
        m, v = torch.zeros(numel), torch.zeros(numel)
        for step in range(1, 301):
            grad = torch.full((numel,), 0.5)
            compact_step(stored, grad, m, v, codecs=codecs, numel=numel, out=None, key=sr_key(step, 0), index=0,
                         threads=None, hyper=dict(hyper, step=step), compensation=compensation)
        finals[master] = decoded(codecs.master, stored, numel) if compensation is None else \
            stored.float() + compensation.float()
    assert (finals["bf16"] == 1.0).all()
    assert (finals["fp32"] < 0.975).all()
    moved = 1.0 - finals["fp32"]
    assert ((finals["bf16-kahan"] - finals["fp32"]).abs() <= 0.02 * moved).all(), \
        ((finals["bf16-kahan"] - finals["fp32"]).abs() / moved).max()


def config(**sections):
    base = {"train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                  "offload_param": {"device": "cpu"}}}
    return load_config({**base, **sections})


def test_config_reads_ours_and_deepspeed_s_keys():
    assert config().state_format == StateFormat()
    assert config(zero_tiering={"master": "bf16-kahan"}, bf16={"enabled": True}).state_format \
        == StateFormat("fp32", "bf16-kahan")
    assert config(zero_tiering={"moments": "int8", "master": "bf16-sr"}, bf16={"enabled": True}).state_format \
        == StateFormat("int8", "bf16-sr")
    assert config(bf16={"enabled": True, "bf16_optimizer_states": True,
                        "bf16_master_weights_and_grads": True}).state_format == StateFormat("bf16", "bf16")


@pytest.mark.parametrize("sections, key, words", [
    (dict(zero_tiering={"moments": "int4"}), "zero_tiering.moments", "'fp32', 'bf16', 'int8'"),
    (dict(zero_tiering={"master": "bf16-sr"}), "zero_tiering.master", "needs bf16 compute"),
    (dict(zero_tiering={"master": "bf16"}, fp16={"enabled": True}), "zero_tiering.master", "computes in fp16"),
    (dict(bf16={"enabled": True, "bf16_optimizer_states": True}, zero_tiering={"moments": "int8"}),
     "zero_tiering.moments", "bf16.bf16_optimizer_states asks for 'bf16'"),
    # DeepSpeed's bf16 key without bf16 compute: the error names the key the user wrote, not ours
    (dict(bf16={"enabled": False, "bf16_master_weights_and_grads": True}), "bf16.bf16_master_weights_and_grads",
     "needs bf16 compute"),
])
def test_a_format_the_run_cannot_serve_names_the_key(sections, key, words):
    with pytest.raises(ConfigError) as info:
        config(**sections)
    assert info.value.key == key and words in str(info.value), str(info.value)


@needs_kernel
def test_compact_choice_names_the_implementation_the_step_runs(monkeypatch):
    """What bench/adam.py prints beside its figures: the kernel and its int8 codecs' path, or the pure-torch step (an
    unbuilt kernel made an H200 host's int8 figure 9 M/s with nothing saying why)."""
    assert compact_step_module.compact_choice() == f"the C kernel (int8 codecs: {kernel.int8_path()})"
    monkeypatch.setattr(compact_step_module, "_kernel", lambda: (None,))
    assert compact_step_module.compact_choice().startswith("torch_compact_step (pure torch")
