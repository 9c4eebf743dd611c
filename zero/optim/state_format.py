"""State formats: how a sub-group's optimizer state is stored (DESIGN.md, "state format").

Exact (fp32 master and moments) is the default and is torch AdamW bit for bit. A compact format stores the
moments in bf16 or block-wise int8, and the master in bf16 (rounded to nearest, as DeepSpeed's
`bf16_master_weights_and_grads`; stochastically; or with a bf16 compensation beside it, `Kahan`): fewer bytes read
and written each step, at a price in loss that bench/quality.py measures. Each part is a `Codec`: its storage
(dtype and element count of its segment), `encode` and `decode` from and to fp32. The fused step over these codecs is
compact_step.py; the driver branches on a format only to hold a Kahan master's compensation beside it.

Block-wise int8 (Dettmers et al., "8-bit Optimizers via Block-wise Quantization"): blocks of 256 elements, each
with its fp32 absmax; an element is the nearest of 256 codes of a dynamic map times its block's absmax, signed for
the first moment, unsigned for the second. Blocks never straddle two parameters: a sub-group's moments are stored
tensor by tensor (`Tiled`), each parameter's part quantized from its own first element, and parameters under 4096
elements (biases, norms) keep fp32 moments, their quantization error not worth their bytes (as bitsandbytes and
torchao do).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

MomentsFormat = Literal["fp32", "bf16", "int8"]
MasterFormat = Literal["fp32", "bf16", "bf16-sr", "bf16-kahan"]
MOMENTS: tuple[str, ...] = ("fp32", "bf16", "int8")
MASTERS: tuple[str, ...] = ("fp32", "bf16", "bf16-sr", "bf16-kahan")

QBLOCK = 256
"""Elements sharing one absmax in block-wise int8."""
SMALLEST_INT8 = 4096
"""Parameters with fewer elements keep fp32 moments."""
TILE_ALIGN = 4
"""Bytes each tile of a `Tiled` segment starts on a multiple of (an fp32 tile's alignment)."""
TINY = 2.0 ** -100
"""A block whose absmax is below this is stored as zeros: every code times a larger absmax is a normal fp32
number, so decoding and encoding again gives the same bytes (a checkpoint stores decoded values)."""


class Codec:
    """One part's storage: `kind` (the C kernel's code), `dtype`, `storage_numel(n)`, `encode`, `decode`."""

    kind = 0
    dtype = torch.float32

    def storage_numel(self, numel: int) -> int:
        return numel

    def __repr__(self) -> str:
        return self.name

    def nbytes(self, numel: int) -> int:
        return self.storage_numel(numel) * self.dtype.itemsize

    def decode(self, stored: torch.Tensor, numel: int, out: torch.Tensor, start: int = 0) -> None:
        """Elements [start, start + out.numel()) of the values a segment `stored` of `numel` elements holds, into
        fp32 `out` (start a multiple of QBLOCK)."""
        out.copy_(stored.narrow(0, start, out.numel()))

    def encode(self, values: torch.Tensor, stored: torch.Tensor, numel: int, start: int = 0) -> None:
        """fp32 `values` into elements [start, start + values.numel()) of a segment `stored` of `numel` elements,
        rounded to nearest (start a multiple of QBLOCK, and the run whole blocks or the segment's end)."""
        stored.narrow(0, start, values.numel()).copy_(values)


class Fp32(Codec):
    name = "fp32"


class Bf16(Codec):
    """bf16, rounded to nearest even (torch's conversion)."""

    name, kind, dtype = "bf16", 1, torch.bfloat16


class Int8Blocks(Codec):
    """Block-wise int8: the segment (uint8) holds each block's fp32 absmax first, then one code per element.
    Unsigned (the second moment), the threshold between codes 0 and 1 is 0, not their midpoint: a positive value
    below ~1e-7 of its block's absmax rounds up to the smallest code, never to 0, or a later step with a zero
    gradient would move the weight by lr * m / eps (hundreds of times lr). The C kernel's bucket table is built
    from these thresholds, so both implementations round alike."""

    dtype = torch.uint8

    def __init__(self, signed: bool):
        self.signed = signed
        self.name = "int8"
        self.kind = 2 if signed else 3
        self.values, self.midpoints = dynamic_map(signed)
        if not signed:  # a positive second moment never encodes as 0: Adam would divide a first moment by eps alone
            self.midpoints = torch.cat([torch.zeros(1), self.midpoints[1:]])
        self.planes = self.values.view(torch.uint8).view(256, 4).t().contiguous()  # the C kernel's decode (VBMI)
        self.buckets = buckets(self.midpoints)
        self.zero = int(torch.nonzero(self.values == 0)[0])

    @staticmethod
    def blocks(numel: int) -> int:
        return -(-numel // QBLOCK)

    def storage_numel(self, numel: int) -> int:
        return 4 * self.blocks(numel) + numel

    def split(self, stored: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(absmax fp32 [blocks], codes uint8 [numel]) views of a segment holding `numel` elements."""
        nblocks = self.blocks(numel)
        return stored.narrow(0, 0, 4 * nblocks).view(torch.float32), stored.narrow(0, 4 * nblocks, numel)

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, midpoints) on `device` (the torch path steps state kept on a GPU there)."""
        if device.type == "cpu":
            return self.values, self.midpoints
        return self._tables_on(device)

    @functools.cache
    def _tables_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.values.to(device), self.midpoints.to(device)

    def decode(self, stored: torch.Tensor, numel: int, out: torch.Tensor, start: int = 0) -> None:
        absmax, codes = self.split(stored, numel)
        n = out.numel()
        scale = absmax.narrow(0, start // QBLOCK, self.blocks(n)).repeat_interleave(QBLOCK)[:n]
        torch.mul(self.tables(out.device)[0][codes.narrow(0, start, n).long()], scale, out=out)

    def encode(self, values: torch.Tensor, stored: torch.Tensor, numel: int, start: int = 0) -> None:
        absmax_all, codes_all = self.split(stored, numel)
        n = values.numel()
        nblocks = self.blocks(n)
        padded = torch.zeros(nblocks * QBLOCK, dtype=torch.float32, device=values.device)
        padded[:n] = values
        blocks = padded.view(nblocks, QBLOCK)
        absmax = blocks.abs().amax(dim=1)
        empty = absmax < TINY  # zero, or too small for every code times it to stay a normal float: all zeros
        absmax = torch.where(empty, torch.zeros_like(absmax), absmax)
        inverse = torch.reciprocal(torch.where(absmax > 0, absmax, torch.ones_like(absmax)))
        scaled = (blocks * inverse[:, None]).view(-1)[:n]
        codes = torch.searchsorted(self.tables(values.device)[1], scaled)  # thresholds below: the nearest code
        codes = torch.where(torch.isnan(scaled), self.zero, codes)
        codes = torch.where(empty.repeat_interleave(QBLOCK)[:n], 0, codes)
        absmax_all.narrow(0, start // QBLOCK, nblocks).copy_(absmax)
        codes_all.narrow(0, start, n).copy_(codes)


class Kahan:
    """A bf16-kahan master: the bf16 weights (stored as `BF16`, the parameter shard itself where it can be) and a
    bf16 compensation in a segment of its own, holding what the weights' rounding dropped (Kahan-compensated
    summation, the sum taken in fp32): the value is weights + compensation, about 16 bits of mantissa, so updates
    far below a bf16 step accumulate instead of vanishing. Both round to nearest (unbiased); the pair is then
    rounded once more from its own sum, so that decoding and encoding again gives the same bytes (a checkpoint
    stores decoded values): a remainder rounded up to half a step would otherwise re-round the weight to its even
    neighbour. A weight that is not finite gets a zero compensation."""

    dtype = torch.bfloat16

    @staticmethod
    def decode(weights: torch.Tensor, compensation: torch.Tensor, out: torch.Tensor) -> None:
        torch.add(weights.float(), compensation.float(), out=out)

    @staticmethod
    def encode(values: torch.Tensor, weights: torch.Tensor, compensation: torch.Tensor) -> None:
        for _ in range(2):  # the second pass: the pair's own sum (exact in fp32), re-rounded
            weights.copy_(values)
            w = weights.float()
            compensation.copy_(torch.where(torch.isfinite(w), values - w, 0))  # the difference is exact in fp32
            values = w + compensation.float()


@dataclass(frozen=True)
class Tile:
    """Elements [start, start + numel) of a sub-group, stored with `codec` from byte `offset` of a `Tiled` segment."""

    start: int
    numel: int
    codec: Codec
    offset: int

    def view(self, stored: torch.Tensor) -> torch.Tensor:
        """This tile's storage in a `Tiled` segment's bytes."""
        return stored.narrow(0, self.offset, self.codec.nbytes(self.numel)).view(self.codec.dtype)


class Tiled(Codec):
    """A segment (uint8) holding consecutive runs of a sub-group each stored with its own codec: block-wise int8
    for each large parameter's part (its blocks start at its own first element), fp32 for small parameters and
    padding. Decoded and encoded whole; the step (compact_step.py) walks the tiles."""

    dtype = torch.uint8

    def __init__(self, runs: list[tuple[int, int, Codec]]):
        tiles, offset = [], 0
        for start, numel, codec in runs:
            tiles.append(Tile(start, numel, codec, offset))
            offset += -(-codec.nbytes(numel) // TILE_ALIGN) * TILE_ALIGN
        self.tiles, self.total = tuple(tiles), offset
        self.name = "+".join(sorted({c.name for _, _, c in runs}))

    def storage_numel(self, numel: int) -> int:
        return self.total

    def decode(self, stored: torch.Tensor, numel: int, out: torch.Tensor, start: int = 0) -> None:
        if start or out.numel() != numel:
            raise ValueError("a tiled segment decodes whole: the step walks its tiles")
        for tile in self.tiles:
            tile.codec.decode(tile.view(stored), tile.numel, out.narrow(0, tile.start, tile.numel))

    def encode(self, values: torch.Tensor, stored: torch.Tensor, numel: int, start: int = 0) -> None:
        if start or values.numel() != numel:
            raise ValueError("a tiled segment encodes whole: the step walks its tiles")
        for tile in self.tiles:
            tile.codec.encode(values.narrow(0, tile.start, tile.numel), tile.view(stored), tile.numel)


def int8_runs(numel: int, index: int, extents) -> list[tuple[int, int, bool]]:
    """(start, numel, quantized) runs of a sub-group of `numel` elements starting at element `index` of its unit's
    flat buffer, whose parameters lie at `extents` ((offset, numel) in that buffer: FlatUnit.extents; None: the
    sub-group is one tensor): a run per large parameter's part, quantized; small parameters and the padding
    between, fp32, merged."""
    if extents is None:
        return [(0, numel, numel >= SMALLEST_INT8)]
    runs: list[tuple[int, int, bool]] = []

    def add(start: int, stop: int, quantized: bool) -> None:
        if stop <= start:
            return
        if runs and not quantized and not runs[-1][2]:
            runs[-1] = (runs[-1][0], stop - runs[-1][0], False)
        else:
            runs.append((start, stop - start, quantized))

    at = 0
    for offset, size in sorted(extents):
        lo, hi = max(offset - index, at), min(offset + size - index, numel)
        if lo >= hi:
            continue
        add(at, lo, False)
        add(lo, hi, size >= SMALLEST_INT8)
        at = hi
    add(at, numel, False)
    return runs


@functools.cache
def dynamic_map(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(256 sorted fp32 code values in [-1, 1] (signed) or [0, 1], the 255 fp32 midpoints between neighbours).

    A dynamic (tree) map: seven decades 1e-6 .. 1, the decade 10^(k-6) holding 2^k linearly spaced values
    (midpoints of 0.1 .. 1 cut in 2^k) per sign, so small magnitudes keep relative precision. Signed: both signs,
    the smallest decade positive only, with 0 and +-1; unsigned: 2^(k+1) per decade, with 0 and 1."""
    import numpy as np

    values = [0.0, 1.0] + ([-1.0] if signed else [])
    for k in range(7):
        count = 2 ** k if signed else 2 ** (k + 1)
        edges = np.linspace(0.1, 1.0, count + 1)
        level = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (k - 6)
        values += level.tolist()
        if signed and k > 0:
            values += (-level).tolist()
    table = np.array(sorted(set(np.float32(values).tolist())), dtype=np.float64)
    if table.size != 256:
        raise AssertionError(f"the int8 map has {table.size} distinct codes, not 256")
    midpoints = ((table[:-1] + table[1:]) / 2).astype(np.float32)
    return torch.from_numpy(table.astype(np.float32)), torch.from_numpy(midpoints)


def buckets(midpoints: torch.Tensor) -> torch.Tensor:
    """For each of the 2^17 buckets of fp32 values sharing their top 17 bits (sign, exponent, 8 bits of mantissa),
    the C kernel's nearest-code search in one 32-bit entry (int32): bits 0-7 how many midpoints lie below the
    bucket, bit 8 set where the bucket holds the next one, bits 16-30 that midpoint's low 15 bits (its top 17 are
    the bucket's). No bucket holds two midpoints (checked here), so one table read and one comparison find the
    nearest code, with no second read of the midpoint."""
    import numpy as np

    mid = midpoints.numpy()
    index = np.arange(1 << 17, dtype=np.uint32)
    low, high = (index << 15).view(np.float32), ((index << 15) | 0x7FFF).view(np.float32)
    negative = index >> 16 == 1
    least, most = np.where(negative, high, low), np.where(negative, low, high)
    below = np.searchsorted(mid, least, side="left")
    finite = np.isfinite(least) & np.isfinite(most)
    inside = np.where(finite, np.searchsorted(mid, most, side="right") - below, 0)
    if inside.max() > 1:
        raise AssertionError("a bucket of the int8 map holds two midpoints: the kernel's search would miss one")
    held = inside == 1
    low_bits = mid.view(np.uint32)[np.minimum(below, mid.size - 1)] & 0x7FFF
    entry = np.minimum(below, 255).astype(np.uint32) | held.astype(np.uint32) << 8 | np.where(held, low_bits, 0) << 16
    return torch.from_numpy(entry.astype(np.int32))


FP32, BF16 = Fp32(), Bf16()
INT8_SIGNED, INT8_UNSIGNED = Int8Blocks(signed=True), Int8Blocks(signed=False)


@dataclass(frozen=True)
class StateFormat:
    """The state format a run asked for (zero_tiering.moments / .master, or DeepSpeed's bf16 keys)."""

    moments: MomentsFormat = "fp32"
    master: MasterFormat = "fp32"

    def __post_init__(self) -> None:
        if self.moments not in MOMENTS:
            raise ValueError(f"moments format {self.moments!r}: one of {', '.join(MOMENTS)}")
        if self.master not in MASTERS:
            raise ValueError(f"master format {self.master!r}: one of {', '.join(MASTERS)}")

    @property
    def exact(self) -> bool:
        return self.moments == "fp32" and self.master == "fp32"

    @property
    def master_dtype(self) -> torch.dtype:
        return torch.float32 if self.master == "fp32" else torch.bfloat16

    def codecs(self, numel: int, index: int = 0, extents=None) -> SubGroupCodecs:
        """The codecs of a sub-group of `numel` elements from element `index` of its unit's flat buffer, whose
        parameters lie at `extents` ((offset, numel) in that buffer; None: the sub-group is one tensor)."""
        m = v = BF16 if self.moments == "bf16" else FP32
        if self.moments == "int8":
            runs = int8_runs(numel, index, extents)
            if len(runs) == 1:
                m, v = (INT8_SIGNED, INT8_UNSIGNED) if runs[0][2] else (FP32, FP32)
            else:
                m, v = (Tiled([(start, n, signed if quantized else FP32) for start, n, quantized in runs])
                        for signed in (INT8_SIGNED, INT8_UNSIGNED))
        return SubGroupCodecs(FP32 if self.master == "fp32" else BF16, m, v, self.master == "bf16-sr",
                              self.master == "bf16-kahan")

    def state_bytes(self, numel: int, *, master: bool = True, index: int = 0, extents=None) -> int:
        """Bytes of a sub-group's stored state (with its master, unless the master is the parameter shard);
        `index`, `extents`: as `codecs` takes them."""
        return sum(self.segment_bytes(numel, master=master, index=index, extents=extents))

    def segment_bytes(self, numel: int, *, master: bool = True, index: int = 0, extents=None) -> list[int]:
        """`state_bytes` by segment (the master's, the moments', a Kahan master's compensation): each is charged
        whole pages where it rests."""
        codecs = self.codecs(numel, index, extents)
        return ([codecs.master.nbytes(numel)] if master else []) + [codecs.exp_avg.nbytes(numel),
                codecs.exp_avg_sq.nbytes(numel)] + ([2 * numel] if codecs.compensated else [])

    def describe(self) -> str:
        return "exact (fp32 master and moments)" if self.exact else f"moments {self.moments}, master {self.master}"


@dataclass(frozen=True)
class SubGroupCodecs:
    """What one sub-group's parts are stored as."""

    master: Codec
    exp_avg: Codec
    exp_avg_sq: Codec
    stochastic: bool
    """The master is rounded stochastically (bf16-sr) when the step writes it."""
    compensated: bool = False
    """The master has a "compensation" part beside it (bf16-kahan: `Kahan`)."""

    @property
    def exact(self) -> bool:
        return all(c is FP32 for c in (self.master, self.exp_avg, self.exp_avg_sq))

    def of(self, part: str) -> Codec:
        return BF16 if part == "compensation" else getattr(self, part)

    def runs(self, numel: int) -> list[tuple[int, int, SubGroupCodecs, Tile | None, Tile | None]]:
        """(start, numel, codecs, exp_avg tile, exp_avg_sq tile) of each run of a sub-group of `numel` elements
        whose parts are stored in one codec each (the tiles None where the moments are not `Tiled`: one run)."""
        if not isinstance(self.exp_avg, Tiled):
            return [(0, numel, self, None, None)]
        return [(m.start, m.numel, SubGroupCodecs(self.master, m.codec, v.codec, self.stochastic, self.compensated),
                 m, v)
                for m, v in zip(self.exp_avg.tiles, self.exp_avg_sq.tiles)]
