"""Byte sizes written the way people write them ("2GiB", "512MB", "1.5 GiB", 4096), parsed exactly.

Budgets are hard limits, so a size is never rounded: "1.5KB" is 1500 bytes, "0.3KiB" (307.2 bytes) is an
error. KB/MB/GB/TB/PB are powers of 1000 and KiB/MiB/GiB/TiB/PiB powers of 1024, as in IEC 80000-13;
unit letters are case-insensitive.
"""
from __future__ import annotations

import math
import re
from fractions import Fraction

UNITS = {
    "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4, "pb": 1000**5,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "pib": 1 << 50,
}
BINARY_UNITS = (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(value: object) -> int:
    """Bytes from an int, an integral float (JSON's 2e9) or a string with an optional unit.

    Raises ValueError with the reason (the caller names the key)."""
    if isinstance(value, bool):
        raise ValueError("expected a size in bytes, not true/false")
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError("expected a whole number of bytes")
        nbytes = int(value)
    elif isinstance(value, str):
        match = _SIZE.fullmatch(value)
        unit = match.group(2).lower() if match else ""
        if match is None or (unit and unit not in UNITS):
            raise ValueError(
                "expected a size such as 4096, \"512MB\" or \"2GiB\" (units: B, KB, MB, GB, TB, PB, "
                "KiB, MiB, GiB, TiB, PiB)"
            )
        exact = Fraction(match.group(1)) * UNITS[unit or "b"]
        if exact.denominator != 1:
            raise ValueError(f"is {float(exact)} bytes, not a whole number of bytes")
        nbytes = int(exact)
    else:
        raise ValueError("expected a size in bytes: an integer or a string such as \"2GiB\"")
    if nbytes < 0:
        raise ValueError("expected a size >= 0 bytes")
    return nbytes


def format_size(nbytes: int) -> str:
    """The shortest exact spelling in binary units ("2GiB", "1536KiB", "1000B"); parse_size reads it back."""
    for name, scale in BINARY_UNITS:
        if nbytes and nbytes % scale == 0:
            return f"{nbytes // scale}{name}"
    return f"{nbytes}B"
