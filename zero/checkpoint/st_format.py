"""The safetensors file our exports write and our loaders read: its name, the dtype codes, the header, and the
metadata key listing tied names. Apart from export.py so that loading weights never imports the export command
(`python -m zero.export` would then run a module already imported)."""
from __future__ import annotations

import json
import struct

import torch

from .format import CheckpointCorruptError

SAFETENSORS = "model.safetensors"
ALIASES_KEY = "zero_tiering_aliases"
ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def header_bytes(plan: list, metadata: dict[str, str]) -> bytes:
    """The safetensors header for `plan`: JSON padded with spaces to a multiple of 8 bytes, after its
    8-byte little-endian length."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, _ in plan:
        if dtype not in ST_DTYPES:
            raise CheckpointCorruptError("", f"{name!r} has dtype {dtype}, which safetensors cannot hold")
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw
