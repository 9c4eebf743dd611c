"""A gradient added, and its norms taken, across dtypes in chunks: a 16-bit part is cast a chunk at a time into a
small reused fp32 buffer (it stays in the cache) rather than whole into scratch of the part's size (a pass over
memory, and a buffer of the largest unit's size) or into a fresh temporary per piece (what torch's mixed-dtype
`add_` and `vector_norm(..., dtype=)` allocate: page faults every step, and freed memory that glibc's per-thread
arenas keep). The buffers are per thread and device.

The norm of a 16-bit piece longer than a chunk is the norm of its chunks' norms: the same value in exact arithmetic,
not the same bits as torch's norm of the whole piece cast to fp32; every norm of the accumulated gradient is taken
here, so each is computed one way. fp32 pieces are torch's `vector_norm` as they are (clipping's bits)."""
from __future__ import annotations

import threading

import torch

CHUNK = 1 << 17
"""Elements cast at a time: two buffers of 512 KiB of fp32 (the part's and, for a 16-bit sum, the accumulator's),
within a core's L2 cache."""
BUFFER_BYTES = 2 * CHUNK * 4
"""What one thread's buffers take on a device."""

_buffers = threading.local()


def _buffer(device: torch.device, numel: int, which: int = 0) -> torch.Tensor:
    held = _buffers.__dict__.setdefault("by_device", {})
    buffer = held.get(device)
    if buffer is None:
        buffer = held[device] = torch.empty(BUFFER_BYTES // 4, dtype=torch.float32, device=device)
    return buffer.narrow(0, which * CHUNK, numel)


def add_into(acc: torch.Tensor, grad: torch.Tensor) -> None:
    """acc += grad (1-D, the same length), the sum taken in fp32 and rounded once to acc's dtype."""
    if acc.dtype == torch.float32 and grad.dtype == torch.float32:
        acc.add_(grad)
        return
    for start in range(0, acc.numel(), CHUNK):
        n = min(CHUNK, acc.numel() - start)
        part, into = _buffer(acc.device, n).copy_(grad.narrow(0, start, n)), acc.narrow(0, start, n)
        if acc.dtype == torch.float32:
            into.add_(part)
        else:
            into.copy_(_buffer(acc.device, n, 1).copy_(into).add_(part))


def norm_of(piece: torch.Tensor) -> torch.Tensor:
    """The fp32 2-norm of a 1-D piece of any float dtype (0-dim, on the piece's device)."""
    if piece.dtype == torch.float32:
        return torch.linalg.vector_norm(piece)
    norms = []
    for start in range(0, max(piece.numel(), 1), CHUNK):
        n = min(CHUNK, piece.numel() - start)
        norms.append(torch.linalg.vector_norm(_buffer(piece.device, n).copy_(piece.narrow(0, start, n))))
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
