"""DeepSpeed's `deepspeed.runtime.utils` helpers that scripts call: `set_random_seed` (python's, numpy's and torch's
generators) and `see_memory_usage` (a report of the accelerator's and the machine's memory)."""
from __future__ import annotations

import gc
import random

import numpy
import torch
import torch.distributed as dist

from ..accelerator import get_accelerator
from ..report.checks import meminfo

GIB = 1 << 30


def set_random_seed(seed: int) -> None:
    """Seed python's `random`, numpy's global generator and torch's (every device's), as DeepSpeed's does: numpy
    takes the seed modulo 2**32, torch modulo 2**63."""
    random.seed(seed)
    numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)


def see_memory_usage(message: str, force: bool = False) -> None:
    """With `force` (DeepSpeed's switch: without it nothing happens), print `message` and, in DeepSpeed's format, the
    accelerator's memory allocated and reserved by torch with their peaks (0 on the CPU, which has no such counters),
    then the machine's memory in use (MemTotal - MemAvailable); the peaks restart from here. Rank 0 only."""
    if not force or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()  # what is garbage already would count as used
    acc = get_accelerator()
    cuda = torch.cuda.is_available()
    reserved = torch.cuda.memory_reserved() if cuda else 0
    max_reserved = torch.cuda.max_memory_reserved() if cuda else 0
    print(message)
    print(f"MA {round(acc.memory_allocated() / GIB, 2)} GB Max_MA {round(acc.max_memory_allocated() / GIB, 2)} GB "
          f"CA {round(reserved / GIB, 2)} GB Max_CA {round(max_reserved / GIB, 2)} GB")
    info = meminfo()
    total, used = info["MemTotal"], info["MemTotal"] - info["MemAvailable"]
    print(f"CPU Virtual Memory:  used = {round(used / GIB, 2)} GB, percent = {round(100 * used / total, 1)}%")
    acc.reset_peak_memory_stats()
