"""Page-aligned host tensors: O_DIRECT needs buffer addresses, file offsets and lengths aligned to 4 KiB."""
from __future__ import annotations

import mmap
import weakref

import torch

from .errors import AlignmentError, PinnedMemoryError

ALIGNMENT = 4096
HUGE_PAGE = 2 << 20
"""x86-64's transparent huge page: buffers at least this large are advised to use them (aligned_empty)."""


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def aligned_empty(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """A uint8 tensor of `nbytes` (rounded up to 4 KiB) whose first byte is 4 KiB aligned.

    The pages are touched (zeroed) here, once: first-touch page faults cost ~10x a warm copy on a VM. The memory
    is its own anonymous mapping, unmapped when the tensor (and every view of it) dies: from malloc, buffers of up
    to 32 MiB come from the heap once glibc has raised its mmap threshold, and freed ones stay in the process
    (RSS) beyond any budget. A mapping of 2 MiB or more asks for transparent huge pages (madvise): an O_DIRECT
    request is cut where its buffer's pages are not physically contiguous (the device's segment limit), and on
    4 KiB pages an 8 MiB block reached this VM's virtio disk as ~1 MiB requests at ~1 GB/s; on huge pages as
    ~3.4 MiB ones, and the disk-bound step ran 1.7x faster (bench/RESULTS.md, session 22). `pin`: the mapping is
    page-locked with the CUDA runtime, exactly its size (torch's pinned allocator rounds each request up to a power
    of two: a 2^k buffer would pin 2^(k+1)), and unlocked when it is unmapped.
    """
    size = align_up(max(nbytes, 1))
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if size >= HUGE_PAGE:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8).zero_()  # page-aligned; keeps the mapping alive
    if pin:
        _page_lock(mapping, buffer.data_ptr(), size)
    return buffer


def _page_lock(mapping: mmap.mmap, address: int, size: int) -> None:
    cudart = torch.cuda.cudart()
    error = int(cudart.cudaHostRegister(address, size, 0))
    if error:
        raise PinnedMemoryError(size, error)
    weakref.finalize(mapping, cudart.cudaHostUnregister, address)  # before the mapping goes


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
