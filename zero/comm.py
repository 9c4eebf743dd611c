"""Collectives over flat tensors for the data-parallel ranks, with one rank needing no process group.

`DataParallel.from_env()` joins the group torchrun describes (gloo on CPU, NCCL on GPU) or, with no
WORLD_SIZE or WORLD_SIZE=1, stands alone: every collective is then the identity.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def local_device() -> torch.device:
    """The device this process computes on: with CUDA, GPU LOCAL_RANK under torchrun (made the current one, so
    every allocation and NCCL collective lands there), else the current GPU; the CPU without CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return torch.device("cuda", torch.cuda.current_device())


class DataParallel:
    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.active = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if self.active else 1
        self.rank = dist.get_rank(group) if self.active else 0

    @classmethod
    def from_env(cls, device: torch.device) -> DataParallel:
        """Join the process group torchrun set up in the environment, if there is more than one rank."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=timedelta(minutes=10))
        return cls()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        if tensor.device.type == "cpu" and dist.get_backend(self.group) == "nccl":
            # NCCL reduces device memory only (a host tensor: the gradient norm with the optimizer offloaded).
            on_device = tensor.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(on_device, group=self.group)
            return tensor.copy_(on_device)
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def reduce_scatter_sum(self, flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Sum `flat` (world_size equal shards) over ranks; `out` receives this rank's shard of the sum."""
        if self.world_size == 1:
            return out.copy_(flat)
        if flat.device.type == "cpu":  # gloo has no reduce_scatter: reduce all, keep our slice
            dist.all_reduce(flat, group=self.group)
            return out.copy_(flat.view(self.world_size, -1)[self.rank])
        dist.reduce_scatter_tensor(out, flat, group=self.group)
        return out

    def all_gather(self, shard: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `shard` into `out` (world_size x shard.numel() elements)."""
        if self.world_size == 1:
            return out.copy_(shard)
        if out.device.type == "cpu":
            dist.all_gather(list(out.view(self.world_size, -1).unbind(0)), shard, group=self.group)
        else:
            dist.all_gather_into_tensor(out, shard, group=self.group)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)
