"""Frozen weights stored as block-wise int8 (DeepSpeed's ZeRO++ `zero_quantized_nontrainable_weights`): a frozen
unit's shard rests in its tier as one fp32 scale per block of 256 elements followed by one signed byte per element,
and is decoded into the compute dtype where it is gathered. Half the bytes of bf16 read at every gather (a quarter of
fp32's), for a base that is never written back, so its error is paid once, not compounded.

Symmetric and linear per block, as ZeRO++ quantizes weights: code = round(x / absmax x 127), value = code x absmax /
127. Blocks run over the shard's flat elements (a block may hold the end of one parameter and the start of the
next). Decoding is plain tensor arithmetic, on whichever device holds the bytes: the same values on a CPU and a GPU.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .flat_unit import FlatUnit

BLOCK = 256
"""Elements sharing one scale."""
LEVELS = 127
"""Codes run from -LEVELS to LEVELS."""
CHUNK_BLOCKS = 4096
"""Blocks `encode` works on at once."""


def blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def stored_numel(numel: int) -> int:
    """Bytes a shard of `numel` elements is stored in: the blocks' fp32 absmax, then the codes."""
    return 4 * blocks(numel) + numel


def encode(values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`values` (any floating dtype, flat) into `out` (uint8, stored_numel(values.numel()) bytes); returns out.
    A chunk of blocks at a time: its temporaries are a chunk's, not the shard's (a whole model's embedding is one
    shard)."""
    n, nblocks = values.numel(), blocks(values.numel())
    flat = values.reshape(-1)
    absmax_all = out.narrow(0, 0, 4 * nblocks).view(torch.float32)
    codes_all = out.narrow(0, 4 * nblocks, n).view(torch.int8)
    for first in range(0, nblocks, CHUNK_BLOCKS):
        count = min(CHUNK_BLOCKS, nblocks - first)
        start, stop = first * BLOCK, min(n, (first + count) * BLOCK)
        grid = torch.zeros(count * BLOCK, dtype=torch.float32, device=values.device)
        grid[:stop - start] = flat[start:stop]
        grid = grid.view(count, BLOCK)
        absmax = grid.abs().amax(dim=1)
        scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        codes = grid.div_(scale[:, None]).mul_(LEVELS).round_().clamp_(-LEVELS, LEVELS).to(torch.int8)
        absmax_all.narrow(0, first, count).copy_(absmax)
        codes_all.narrow(0, start, stop - start).copy_(codes.view(-1)[:stop - start])
    return out


def decode(stored: torch.Tensor, numel: int, out: torch.Tensor) -> torch.Tensor:
    """The `numel` values a uint8 `stored` holds, into `out` (flat, its dtype: the compute dtype); returns out. Two
    passes over `out` and no temporary of its size: the codes converted into it, then each block scaled in place
    (a code times its step, rounded once to out's dtype)."""
    nblocks = blocks(numel)
    step = stored.narrow(0, 0, 4 * nblocks).view(torch.float32) / LEVELS
    out.copy_(stored.narrow(0, 4 * nblocks, numel).view(torch.int8))
    whole = numel // BLOCK
    out.narrow(0, 0, whole * BLOCK).view(whole, BLOCK).mul_(step.narrow(0, 0, whole)[:, None])
    if whole < nblocks:
        out.narrow(0, whole * BLOCK, numel - whole * BLOCK).mul_(step[whole])
    return out


def round_trip(unit: FlatUnit, params: dict[str, torch.Tensor]) -> None:
    """Give the parameters of a frozen unit (`params`: by slot name) the values its int8 shard decodes to: its flat
    buffer (its parameters in its order, padded) encoded and decoded whole. Every rank's shard starts on a multiple
    of 1024 elements (flat_unit.py), so these are the blocks shard by shard too: what a model computes with them is
    what the engine computes. For measuring the format's effect on a model in plain PyTorch."""
    flat = torch.zeros(unit.padded_numel)
    with torch.no_grad():
        for slot in unit.slots:
            flat[slot.offset:slot.offset + slot.numel] = params[slot.name].reshape(-1)
        decode(encode(flat, torch.empty(stored_numel(flat.numel()), dtype=torch.uint8)), flat.numel(), flat)
        for slot in unit.slots:
            params[slot.name].copy_(flat[slot.offset:slot.offset + slot.numel].view(slot.shape))
