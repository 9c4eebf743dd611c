"""Collectives over flat tensors for the data-parallel ranks, with one rank needing no process group.

`DataParallel.from_env()` joins the group torchrun describes (gloo on CPU, NCCL on GPU) or, with no
WORLD_SIZE or WORLD_SIZE=1, stands alone: every collective is then the identity. A collective that fails
because a peer rank died or stopped answering raises RankLostError, so a rank never outlives its job silently.

It is also DeepSpeed's `deepspeed.comm` for scripts (`from deepspeed import comm as dist`): `init_distributed`,
`get_rank`, `get_world_size`, `get_local_rank`, `barrier` and the collectives, torch.distributed's on the group
joined, this one process being the world before one is; its backend classes (`TorchBackend`) import, and raise
UnsupportedFeatureError when built.
"""
from __future__ import annotations

import atexit
import functools
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .integrations.unsupported import stand_ins_getattr


def local_device() -> torch.device:
    """The device this process computes on: with CUDA, GPU LOCAL_RANK under torchrun (made the current one, so
    every allocation and NCCL collective lands there), else the current GPU; the CPU without CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return torch.device("cuda", torch.cuda.current_device())


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1, world_size: int = -1) -> None:
    """DeepSpeed's `init_distributed`: join the process group the launcher (torchrun, `python -m zero.launch`)
    described in the environment, gloo on CPU and NCCL on GPUs unless `dist_backend` says; nothing where a group is
    joined already or `dist_init_required` is False. One rank started without a launcher joins a group of one, as
    DeepSpeed does (a script's own `torch.distributed.get_rank()` and `barrier()` then work), on a free port of
    127.0.0.1 unless MASTER_PORT says. `rank` and `world_size` (>= 0) stand in for RANK and WORLD_SIZE; MPI
    discovery is not done (a launcher's environment is what is read)."""
    if dist.is_initialized() or dist_init_required is False:
        return
    if rank >= 0:
        os.environ["RANK"] = str(rank)
    if world_size >= 0:
        os.environ["WORLD_SIZE"] = str(world_size)
    alone = "MASTER_PORT" not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == 1
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port() if alone else distributed_port))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    backend = dist_backend or ("nccl" if local_device().type == "cuda" else "gloo")
    join_group(backend, init_method=init_method, timeout=timeout or timedelta(minutes=30))


def join_group(backend: str, **kwargs: Any) -> None:
    """init_process_group, and the group destroyed when the process exits (`destroy_at_exit`)."""
    dist.init_process_group(backend, **kwargs)
    destroy_at_exit()


@functools.cache
def destroy_at_exit() -> None:
    """Have the default group destroyed when the process exits, while Python is still whole (a group zero joined, or
    one the caller's launcher did, such as Accelerate's, which nothing else destroys): one left to the interpreter's
    teardown can abort the process there ("terminate called without an active exception": gloo's threads outliving
    it, pytorch/pytorch#190489), after a script that finished its work. A group already destroyed is left alone."""
    atexit.register(_destroy_group)


def _destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now (for a group of one: nobody else needs to know it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankLostError(RuntimeError):
    """A collective failed because a peer rank died (its connection closed) or stopped answering (the
    collective timed out). The group cannot be used again, so this rank stops too, saying what it knows:
    `rank` and `world_size` (this rank's), `collective` (the DataParallel method) and `suspects` (the peer
    ranks that may be lost: the other rank of two; empty where the backend's message cannot tell)."""

    def __init__(self, message: str, *, rank: int, world_size: int, collective: str, suspects: tuple[int, ...]):
        super().__init__(message)
        self.rank, self.world_size, self.collective, self.suspects = rank, world_size, collective, suspects


CLOSED = ("closed by peer", "reset by peer", "broken pipe", "remote process exited")
TIMED_OUT = ("timed out", "timeout")
"""Lowercase fragments of the backends' messages (gloo's, NCCL's) for a peer gone and for a peer silent."""

def collective(method: Callable) -> Callable:
    """Turn a backend's error for a lost peer, raised inside `method`, into RankLostError; other errors (a
    misuse, a shape mismatch) pass unchanged. Costs a try on the way in, nothing else."""
    @functools.wraps(method)
    def run(self: DataParallel, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except RuntimeError as err:
            lost = self.lost(method.__name__, err)
            if lost is None:
                raise
            raise lost from err
    return run


class DataParallel:
    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout: float | None = None):
        """`timeout`: seconds each collective waits, where zero set it when joining the group (for the message
        when one times out); None for a group joined by the caller, whose own timeout rules."""
        self.group = group
        self.timeout = timeout
        self.active = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if self.active else 1
        self.rank = dist.get_rank(group) if self.active else 0

    @staticmethod
    def world_size_to_join(join: bool = True) -> int:
        """The world size `from_env` (join=True) or `DataParallel()` (join=False) will give, known before
        joining: the config, which sets the batch sizes from it, is read first, as it holds the timeout."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return int(os.environ.get("WORLD_SIZE", "1")) if join else 1

    @classmethod
    def from_env(cls, device: torch.device, *, timeout: float) -> DataParallel:
        """Join the process group torchrun set up in the environment, if there is more than one rank, with each
        collective waiting at most `timeout` seconds for the others (zero_tiering.collective_timeout). A group
        the caller initialized is used as it is, with its own timeout."""
        if not dist.is_initialized() and cls.world_size_to_join() > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            join_group(backend, timeout=timedelta(seconds=timeout))
            return cls(timeout=timeout)
        if dist.is_available() and dist.is_initialized():
            destroy_at_exit()
        return cls()

    def lost(self, name: str, err: RuntimeError) -> RankLostError | None:
        """The RankLostError for `err` raised by collective `name`, or None where `err` is not a lost peer."""
        text = str(err)
        low = text.lower()
        timed_out = any(s in low for s in TIMED_OUT)
        if not (isinstance(err, dist.DistNetworkError) or timed_out or any(s in low for s in CLOSED)):
            return None
        suspects = tuple(r for r in range(self.world_size) if r != self.rank) if self.world_size == 2 else ()
        who = f"rank {suspects[0]}" if suspects else f"a peer rank (of {self.world_size})"
        if not timed_out:
            why = "its connection closed: the process died or was killed"
        elif self.timeout is not None:
            why = f"no reply within {self.timeout:g} s, zero_tiering.collective_timeout"
        else:
            why = "no reply within the timeout of the caller's process group"
        message = (f"rank {self.rank} of {self.world_size}: {name} failed: {who} stopped answering ({why}). This "
                   f"rank stops too; checkpoints already saved are untouched. {dist.get_backend(self.group)} said: "
                   f"{text}")
        return RankLostError(message, rank=self.rank, world_size=self.world_size, collective=name,
                             suspects=suspects)

    @collective
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

    @collective
    def reduce_scatter_sum(self, flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Sum `flat` (world_size equal shards) over ranks; `out` receives this rank's shard of the sum."""
        if self.world_size == 1:
            return out.copy_(flat)
        if flat.device.type == "cpu":  # gloo has no reduce_scatter: reduce all, keep our slice
            dist.all_reduce(flat, group=self.group)
            return out.copy_(flat.view(self.world_size, -1)[self.rank])
        dist.reduce_scatter_tensor(out, flat, group=self.group)
        return out

    @collective
    def all_gather(self, shard: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `shard` into `out` (world_size x shard.numel() elements)."""
        if self.world_size == 1:
            return out.copy_(shard)
        if out.device.type == "cpu" and dist.get_backend(self.group) == "nccl":
            # NCCL gathers device memory only (host tensors: zero.Init's slices before initialize).
            device = torch.device("cuda", torch.cuda.current_device())
            on_device = torch.empty(out.shape, dtype=out.dtype, device=device)
            dist.all_gather_into_tensor(on_device, shard.to(device), group=self.group)
            return out.copy_(on_device)
        if out.device.type == "cpu":
            dist.all_gather(list(out.view(self.world_size, -1).unbind(0)), shard, group=self.group)
        else:
            dist.all_gather_into_tensor(out, shard, group=self.group)
        return out

    @collective
    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """`tensor` takes rank `src`'s values on every rank."""
        if self.world_size == 1:
            return tensor
        if tensor.device.type == "cpu" and dist.get_backend(self.group) == "nccl":
            on_device = tensor.to(torch.device("cuda", torch.cuda.current_device()))
            dist.broadcast(on_device, dist.get_global_rank(self.group, src) if self.group else src, group=self.group)
            return tensor.copy_(on_device)
        dist.broadcast(tensor, dist.get_global_rank(self.group, src) if self.group else src, group=self.group)
        return tensor

    @collective
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in rank order: the checkpoint's agreement among ranks."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    @collective
    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


# -- DeepSpeed's `deepspeed.comm` face: what scripts call as `dist.get_rank()` after `from deepspeed import comm as
# dist`. torch.distributed's, on the group joined; before (or without) one, this one process is the world.

ReduceOp = dist.ReduceOp


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """This process's place among its node's ranks (LOCAL_RANK, as the launcher sets it)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group=None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group, group_rank) if is_initialized() and group is not None else group_rank


def barrier(group=None, async_op: bool = False, device_ids=None):
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids) if is_initialized() else None


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op) if is_initialized() else None


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False):
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op) if is_initialized() else None


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    return dist.broadcast(tensor, src, group=group, async_op=async_op) if is_initialized() else None


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, async_op: bool = False):
    if is_initialized():
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    tensor_list[0].copy_(tensor)
    return None


def all_gather_into_tensor(output: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False):
    if is_initialized():
        return dist.all_gather_into_tensor(output, tensor, group=group, async_op=async_op)
    output.copy_(tensor.reshape(output.shape))
    return None


def new_group(ranks=None, **kwargs: Any):
    return dist.new_group(ranks, **kwargs) if is_initialized() else None


__getattr__ = stand_ins_getattr(__name__, "deepspeed.comm", dict.fromkeys(
    ("TorchBackend", "Backend", "CCLBackend", "MPIBackend"),
    "deepspeed.comm's functions (init_distributed, get_rank, all_reduce, ...: zero.comm's, over torch.distributed); "
    "DeepSpeed's backend classes are absent"))
