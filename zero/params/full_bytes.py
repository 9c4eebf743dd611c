"""A partitioned unit's full buffer given bytes when it is gathered and giving them back when it is released.

The full buffer's storage object lives as long as the unit: the parameters are views of it, and so are the tensors
autograd saved in forward, which see the bytes again once the unit is re-gathered for backward. So the bytes come and
go in place: the storage is resized, or (without CUDA, where this torch can) handed the pages of a buffer the device
tier's pool lends, and handed back the pool buffer's own storage when they go.
"""
from __future__ import annotations

import torch

from tiering import SwapManager

from .unit import GATHERED, Unit

SWAPS_STORAGE_BYTES = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
"""Whether this torch can hand a storage another's bytes in place (else a CPU full buffer takes fresh pages)."""


def take_bytes(swap: SwapManager, unit: Unit) -> None:
    """Count the full buffer against the device budget (evicting segments for room) and give it bytes.
    Without CUDA they are the pages of a buffer from the device tier's pool, handed to the full buffer's own
    storage in place (the storage object stays the one autograd's saved views hold): a step reuses pages
    instead of faulting in fresh ones at every gather."""
    tier = swap.device_tier
    swap.reserve_device(unit.nbytes, unit.name, GATHERED)
    storage = unit.full.untyped_storage()
    try:
        lent = tier.lend(unit.nbytes, unit.name) if SWAPS_STORAGE_BYTES else None
        if lent is None:
            with tier.out_of_memory(unit.nbytes, unit.name):
                storage.resize_(unit.nbytes)
        else:
            try:
                storage._swap_data_ptr_(lent.storage.untyped_storage())
            except BaseException:
                lent.release()
                raise
    except BaseException:
        swap.unreserve_device(unit.nbytes, GATHERED)
        raise
    unit.lent = lent
    unit.flat.bind(unit.full)
    if unit.int8:  # where the stored bytes land before they are decoded into the full buffer
        nbytes = swap.segments[unit.segment].nbytes
        try:
            swap.reserve_device(nbytes, f"{unit.name} int8", GATHERED)
        except BaseException:
            free_bytes(swap, unit)  # no room for it: the full buffer's bytes go back too (a prefetch gives up)
            raise
        unit.staging = torch.empty(nbytes, dtype=torch.uint8, device=unit.full.device)


def free_bytes(swap: SwapManager, unit: Unit, *, unbind: bool = True) -> None:
    """Give back the full buffer's bytes, once no copy uses them: with CUDA the caching allocator waits for
    the streams recorded on them; without CUDA the copy worker may still be writing them, so wait for it.
    `unbind` False (a parked unit): the parameters keep their shapes (autograd accumulates their gradients)."""
    if unbind:
        unit.flat.unbind()  # released parameters hold no bytes a stray read could reach (they are 0-element)
    storage = unit.full.untyped_storage()
    if unit.full.is_cuda:
        unit.full.record_stream(torch.cuda.current_stream(unit.full.device))  # the compute that read them
    elif unit.fill is not None:
        unit.fill.settle()
    if unit.lent is None:
        storage.resize_(0)
    else:
        storage._swap_data_ptr_(unit.lent.storage.untyped_storage())  # the pages back to the pool's buffer
        unit.lent.release()
        unit.lent = None
    swap.unreserve_device(unit.nbytes, GATHERED)
    if unit.staging is not None:
        if unit.staging.is_cuda:
            unit.staging.record_stream(torch.cuda.current_stream(unit.staging.device))
        swap.unreserve_device(unit.staging.numel(), GATHERED)
        unit.staging = None
