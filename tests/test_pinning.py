"""Pinned host memory: which config pins (both offload sections, pinned by default where CUDA is present), and,
on a GPU, that the pool's buffers are page-locked at exactly their size (not torch's power-of-two rounding) and
that CUDA running out of memory within the device budget is a typed error."""
from __future__ import annotations

import gc

import pytest
import torch

from tiering import DeviceOutOfMemoryError, HostBufferPool, HostPoolConfig
from tiering.aligned import aligned_empty
from tiering.device_tier import DeviceTier
from zero.services.budgets import pin_memory
from zero.config import load_config


def config(param=None, optimizer=None, device="cpu"):
    sections = {}
    for name, pin in (("offload_param", param), ("offload_optimizer", optimizer)):
        sections[name] = {"device": device} | ({} if pin is None else {"pin_memory": pin})
    return load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, **sections}})


@pytest.mark.parametrize("param,optimizer,pinned", [
    (None, None, True),     # unset: pinned where CUDA is present
    (True, None, True), (None, True, True), (True, False, True),  # either section asking pins the one pool
    (False, None, False), (None, False, False), (False, False, False),
])
def test_pin_memory_is_read_from_both_offload_sections(param, optimizer, pinned):
    assert pin_memory(config(param, optimizer), cuda=True) is pinned


def test_nothing_is_pinned_without_cuda():
    assert pin_memory(config(True, True), cuda=False) is False


def test_a_section_not_offloaded_does_not_decide():
    assert pin_memory(config(False, False, device="none"), cuda=True) is True


@pytest.mark.cuda
def test_pinned_pool_buffers_are_page_locked_at_their_size_within_the_budget():
    budget = 3 * (5 << 20) + 4096
    pool = HostBufferPool(HostPoolConfig(budget=budget, pin=True))
    before = torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0)
    buffers = [pool.acquire(5 << 20, f"b{i}") for i in range(3)]
    assert all(b.storage.is_pinned() for b in buffers)
    assert pool.held <= budget
    # Our own mappings, registered with the runtime: torch's pinned allocator (which rounds 5 MiB up to 8) holds
    # nothing more.
    assert torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0) == before
    for b in buffers:
        b.release()
    assert pool.trim() == 3 * (5 << 20)


@pytest.mark.cuda
def test_a_pinned_buffer_is_unregistered_when_it_dies():
    """The kernel hands a freed mapping's addresses to the next one of the same size: registering it again
    fails (cudaErrorHostMemoryAlreadyRegistered, a PinnedMemoryError) unless the first was unregistered."""
    for _ in range(3):
        buffer = aligned_empty(1 << 20, pin=True)
        assert buffer.is_pinned()
        del buffer
        gc.collect()


@pytest.mark.cuda
def test_cuda_out_of_memory_within_the_budget_is_a_typed_error_naming_the_numbers():
    tier = DeviceTier(None, torch.device("cuda"))
    too_much = 2 * torch.cuda.get_device_properties(tier.device).total_memory
    with pytest.raises(DeviceOutOfMemoryError) as info:
        tier.allocate(too_much, "unit block.7")
    assert info.value.requested == too_much and "unit block.7" in str(info.value)
    assert info.value.budget is None and "no device budget" in str(info.value)
    tier.close()
