"""A gradient added and its norms taken across dtypes a chunk at a time (zero/optim/cast_chunks.py): the sums are
the bits of casting whole and adding in fp32, the norms torch's where a piece fits a chunk and within fp32 rounding
of the exact norm (as torch's are) where it does not, and neither allocates memory of the part's size."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from zero.optim.cast_chunks import BUFFER_BYTES, CHUNK, add_into, norm_of

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LENGTHS = st.sampled_from([0, 1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 13])


def values(n: int, seed: int, dtype: torch.dtype, scale: float) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@settings(max_examples=30, deadline=None)
@given(n=LENGTHS, seed=st.integers(0, 2**16), acc_dtype=st.sampled_from(DTYPES), grad_dtype=st.sampled_from(DTYPES),
       scale=st.sampled_from([1e-6, 1.0, 1e3]))
def test_add_into_is_the_fp32_sum_rounded_once(n, seed, acc_dtype, grad_dtype, scale):
    acc, grad = values(n, seed, acc_dtype, scale), values(n, seed + 1, grad_dtype, scale)
    expected = (acc.float() + grad.float()).to(acc_dtype)
    add_into(acc, grad)
    assert torch.equal(acc, expected)


@settings(max_examples=30, deadline=None)
@given(n=LENGTHS, seed=st.integers(0, 2**16), dtype=st.sampled_from(DTYPES), scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_norm_of_a_piece(n, seed, dtype, scale):
    piece = values(n, seed, dtype, scale)
    norm = norm_of(piece)
    assert norm.dtype == torch.float32 and norm.dim() == 0
    if dtype == torch.float32 or n <= CHUNK:  # torch's bits: clipping's, and the parity tests'
        assert torch.equal(norm, torch.linalg.vector_norm(piece.float()))
    exact = piece.double().square().sum().sqrt()
    assert abs(norm.double() - exact) <= 2e-5 * exact + 1e-30  # fp32 summation, as torch's own


@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.bfloat16])
def test_a_16_bit_part_allocates_nothing_of_its_size(acc_dtype):
    """torch's own mixed-dtype add and cast norm allocate a temporary of the part's size (the memory glibc's
    arenas then keep); these allocate nothing past the first call's buffers."""
    n = 8 * CHUNK
    acc, grad = torch.zeros(n, dtype=acc_dtype), torch.ones(n, dtype=torch.bfloat16)
    add_into(acc, grad), norm_of(grad)  # the buffers, once per thread
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        add_into(acc, grad)
        norm_of(acc)
    largest = max((event.cpu_memory_usage for event in prof.events()), default=0)
    assert largest < BUFFER_BYTES // 2, largest
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        acc.add_(grad) if acc_dtype == torch.float32 else torch.linalg.vector_norm(grad, dtype=torch.float32)
    assert max(event.cpu_memory_usage for event in prof.events()) >= 2 * n  # what the chunks avoid
