"""The machine a plan is for: memory (RAM, GPU), the disk under nvme_path (read, write and mixed GB/s, as
`python -m zero.report --bandwidth` measured them, or given), and this machine's compute rates, measured in a
second or two: matmul FLOP/s at the model's width in the compute dtype, CPU-Adam elements per second, and the
bytes per second of a copy, of fresh memory and of the checksum. Each rate is measured once a process (as
compute_speed.dtype_speed): the plans one process makes price one machine, and the second costs no probe."""
from __future__ import annotations

import functools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tiering.checksum import checksum

from ..config.sizes import parse_size
from ..optim.adam_math import AdamThreads, adam_step
from ..optim.compact_step import compact_step
from ..optim.state_format import FP32, StateFormat
from ..report.bandwidth import DiskFigures
from ..report.checks import meminfo
from .model_source import PlanInputError


@dataclass(frozen=True)
class Machine:
    ram_bytes: int
    gpu_bytes: int
    """0 on a machine without CUDA: the device tier is then host memory, counted in RSS."""
    disk: DiskFigures | None
    """None: no nvme placement is planned."""
    matmul_flops: float
    """FLOP/s of a (tokens x width) @ (width x 4 width) linear layer's forward and two backward matmuls in the
    compute dtype."""
    adam_elements: float
    """CPU-Adam elements stepped per second (fp32 state, copy-out to the compute dtype)."""
    copy_bytes: float
    """Bytes per second a copy between buffers already touched moves (read + written)."""
    fresh_bytes: float
    """Bytes per second of memory allocated and touched for the first time (page faults: autograd's fresh
    gradients and activations every step)."""
    checksum_bytes: float
    """Bytes per second one core checksums (tiering/checksum.py: every byte written to nvme and read back)."""
    compact_adam: dict = field(default_factory=dict)
    """CPU-Adam elements per second for each compact StateFormat planned (compact_adam_rate)."""

    def adam_rate(self, state_format: StateFormat) -> float:
        return self.adam_elements if state_format.exact else self.compact_adam[state_format]


def parse_memory(flag: str, text: str) -> int:
    """A memory figure given on the command line ("24GiB", "80GB"): bytes, or an error naming the flag."""
    try:
        nbytes = parse_size(text)
    except ValueError as exc:
        raise PlanInputError(f"{flag} {text!r}: {exc}") from exc
    if flag == "--ram" and nbytes < (256 << 20):
        raise PlanInputError(f"--ram {text!r}: {nbytes} bytes is not a machine's memory (at least 256MiB)")
    return nbytes


def host_ram() -> int:
    return meminfo()["MemTotal"]


def gpu_memory() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if torch.cuda.is_available() else 0


def per_thread_count(measure):
    """`measure` run once a process for each set of its arguments and torch's thread count (the rates depend on
    it; a process may change it between plans)."""
    cached = functools.cache(lambda threads, *args: measure(*args))

    @functools.wraps(measure)
    def rate(*args):
        return cached(torch.get_num_threads(), *args)
    return rate


@per_thread_count
def matmul_rate(width: int, tokens: int, dtype: torch.dtype) -> float:
    """FLOP/s of a linear layer's training matmuls on this machine (the device when CUDA is present): its
    forward, its input's gradient and its weight's gradient, one after another, as a step runs them. They differ
    (on a CPU with bf16 matrix units the weight's gradient, a transposed product, runs at half the others' rate)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    width = max(64, min(width, 4096))
    tokens = max(64, min(tokens, 2048))
    x = torch.randn(tokens, width, dtype=dtype, device=device)
    w = torch.randn(width, 4 * width, dtype=dtype, device=device)
    g = torch.randn(tokens, 4 * width, dtype=dtype, device=device)

    def layer() -> None:
        x @ w, g @ w.T, x.T @ g  # noqa: B018  (forward, input gradient, weight gradient)

    layer()  # warm-up
    rates = []
    for _ in range(7):  # the median of seven windows: training runs for minutes, so its sustained rate counts
        reps, start = 0, time.perf_counter()
        while reps < 2 or time.perf_counter() - start < 0.1:
            layer()
            reps += 1
        if device == "cuda":
            torch.cuda.synchronize()
        rates.append(reps * 3 * 2 * tokens * width * 4 * width / (time.perf_counter() - start))
    return sorted(rates)[len(rates) // 2]


@per_thread_count
def adam_rate(out_dtype: torch.dtype) -> float:
    """Elements per second of one CPU-Adam step over 4M fp32 elements on torch's threads."""
    n = 4 << 20
    p, g, m, v = (torch.rand(n) for _ in range(4))
    out = torch.empty(n, dtype=out_dtype) if out_dtype != torch.float32 else None
    with AdamThreads() as threads:
        times = []
        for step in range(1, 5):
            start = time.perf_counter()
            adam_step(p, g, m, v, step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                      out=out, threads=threads)
            times.append(time.perf_counter() - start)
    return n / sorted(times)[len(times) // 2]


@per_thread_count
def compact_adam_rate(state_format: StateFormat, out_dtype: torch.dtype) -> float:
    """Elements per second of one CPU-Adam step over 4M elements stored in `state_format` (compact_step, on
    the engine's threads)."""
    n = 4 << 20
    codecs = state_format.codecs(n)
    stored = [torch.zeros(c.storage_numel(n), dtype=c.dtype)
              for c in (codecs.master, codecs.exp_avg, codecs.exp_avg_sq)]
    grad = torch.rand(n)
    out = torch.empty(n, dtype=out_dtype) if out_dtype != torch.float32 and codecs.master is FP32 else None
    with AdamThreads() as threads:
        times = []
        for step in range(1, 5):
            start = time.perf_counter()
            compact_step(stored[0], grad, stored[1], stored[2], codecs=codecs, numel=n, out=out, key=step, index=0,
                         threads=threads, hyper=dict(step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                                     weight_decay=0.01, decoupled=True, grad_scale=1.0))
            times.append(time.perf_counter() - start)
    return n / sorted(times)[len(times) // 2]


@per_thread_count
def memory_rates() -> tuple[float, float]:
    """(copy, fresh) bytes per second over 256 MiB, medians of three."""
    n = 256 << 20
    src, dst = torch.ones(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    copies, fresh = [], []
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src)
        copies.append(2 * n / (time.perf_counter() - start))
        start = time.perf_counter()
        torch.empty(n, dtype=torch.uint8).fill_(1)
        fresh.append(n / (time.perf_counter() - start))
    return sorted(copies)[1], sorted(fresh)[1]


@per_thread_count
def checksum_rate() -> float:
    """Bytes per second `checksum` takes over 256 MiB already touched, the median of three."""
    data = torch.ones(256 << 20, dtype=torch.uint8)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        checksum(data)
        times.append(time.perf_counter() - start)
    return data.numel() / sorted(times)[1]


def nvme_free(directories: Sequence[str], name: str) -> int:
    """Free bytes in the directories the nvme state goes to, each filesystem counted once (two directories on one
    disk share its free space). `name`: what the user gave them as (a flag, a config key), for the error."""
    free = {}
    for path in directories:
        problem = directory_problem(path)
        if problem:
            raise PlanInputError(f"{name} {path!r}: {problem}")
        stat = os.statvfs(path)
        free[os.stat(path).st_dev] = stat.f_bavail * stat.f_frsize
    return sum(free.values())


def directory_problem(path: str) -> str | None:
    """Why `path` cannot hold nvme state ("no such directory", "not a directory"), None when it is a directory."""
    if os.path.isdir(path):
        return None
    return "not a directory" if os.path.exists(path) else "no such directory"
