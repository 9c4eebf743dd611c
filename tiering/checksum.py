"""Checksums of segment bytes on nvme: xxh3-64, ~18 GB/s on one core here (zlib.crc32: ~4 GB/s)."""
from __future__ import annotations

import torch
import xxhash


def checksum(data: torch.Tensor) -> int:
    """xxh3-64 of a contiguous uint8 host tensor's bytes."""
    return xxhash.xxh3_64_intdigest(data.numpy()) if data.numel() else 0
