"""Page-aligned host tensors: O_DIRECT needs buffer addresses, file offsets and lengths aligned to 4 KiB."""
from __future__ import annotations

import mmap

import torch

from .errors import AlignmentError

ALIGNMENT = 4096


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def aligned_empty(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """A uint8 tensor of `nbytes` (rounded up to 4 KiB) whose first byte is 4 KiB aligned.

    The pages are touched (zeroed) here, once: first-touch page faults cost ~10x a warm copy on a VM.
    Unpinned memory is its own anonymous mapping, unmapped when the tensor dies: from malloc, buffers of up
    to 32 MiB come from the heap once glibc has raised its mmap threshold, and freed ones stay in the
    process (RSS) beyond any budget. Pinned memory comes from CUDA; the view keeps its base alive.
    """
    size = align_up(max(nbytes, 1))
    if not pin:
        buffer = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)  # page-aligned; keeps the map alive
        return buffer.zero_()
    base = torch.zeros(size + ALIGNMENT, dtype=torch.uint8, pin_memory=pin)
    skip = (-base.data_ptr()) % ALIGNMENT
    return base[skip : skip + size]


def check_io_buffer(buffer: torch.Tensor, nbytes: int, what: str = "") -> None:
    """Raise unless `buffer` can take O_DIRECT I/O of `nbytes` (rounded up to 4 KiB) at its start.

    `what` (e.g. "write of 8192 bytes at offset 4096 in '/nvme/zt-....swap'") prefixes the message."""
    where = f"{what}: " if what else ""
    if buffer.device.type != "cpu":
        raise AlignmentError(f"{where}I/O buffer must be a host tensor, got device {buffer.device}")
    if not buffer.is_contiguous():
        raise AlignmentError(f"{where}I/O buffer must be contiguous")
    if buffer.data_ptr() % ALIGNMENT:
        raise AlignmentError(
            f"{where}I/O buffer address {buffer.data_ptr():#x} is not {ALIGNMENT}-byte aligned "
            f"(allocate it with tiering.aligned_empty or a HostBufferPool)"
        )
    capacity = buffer.numel() * buffer.element_size()
    if capacity < align_up(nbytes):
        raise AlignmentError(
            f"{where}I/O buffer holds {capacity} bytes, {align_up(nbytes)} needed "
            f"({nbytes} rounded up to {ALIGNMENT})"
        )
