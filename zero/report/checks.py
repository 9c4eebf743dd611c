"""The environment checks: one `Check` per question, each answered from the code that will do the work (the
store's own O_DIRECT probe and engine choice, CPU-Adam's own kernel choice), never from a second guess."""
from __future__ import annotations

import os
import re
import resource
import shutil
import sys
import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from tiering import NvmeStore, NvmeStoreConfig, TieringError, aligned_empty
from tiering.engines import load_aio
from tiering.errors import EngineUnavailableError, fmt_bytes
from ..comm import local_device
from ..services.compute_speed import dtype_speed
from ..optim.adam_math import kernel_choice

RAM_FILESYSTEMS = ("tmpfs", "ramfs")
"""Filesystems whose files are pages of RAM: an nvme tier there saves no memory."""
PIN_PROBE = 64 << 20
"""Bytes of pinned memory the pinning check allocates: enough to meet a small memlock or driver limit."""


@dataclass(frozen=True)
class Check:
    name: str
    verdict: Literal["OK", "WARN", "FAIL"]
    found: str
    fix: str = ""
    """What to do; empty when the verdict is OK."""


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (its kB are KiB)."""
    with open("/proc/meminfo") as f:
        return {key: int(rest.split()[0]) * 1024 for key, rest in (line.split(":", 1) for line in f)}


def filesystem(path: str) -> tuple[str, str]:
    """(type, mount point) of the mount holding `path`: the longest mount point that prefixes its real path
    in /proc/mounts, the later line winning among equals (a later mount hides an earlier one)."""
    real, best = os.path.realpath(path), ("unknown", "")
    with open("/proc/mounts") as f:
        for line in f:
            point, fstype = line.split()[1:3]
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), point)  # a space is written \040
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[1]):
                best = (fstype, point)
    return best


def python_torch() -> list[Check]:
    checks = [Check("python", "OK", f"{sys.version.split()[0]} ({sys.executable})")]
    if torch.cuda.is_available():
        devices = ", ".join(
            f"cuda:{i} {p.name} ({fmt_bytes(p.total_memory)})"
            for i, p in enumerate(map(torch.cuda.get_device_properties, range(torch.cuda.device_count())))
        )
        checks.append(Check("torch", "OK", f"{torch.__version__}, CUDA {torch.version.cuda}: {devices}"))
    else:
        checks.append(Check("torch", "OK", f"{torch.__version__}, no CUDA: the device tier is host memory"))
    cpus = len(os.sched_getaffinity(0))
    checks.append(Check("threads", "OK", f"torch uses {torch.get_num_threads()} threads; {cpus} CPUs for this process"))
    return checks


def compute_dtypes() -> Check:
    """Which 16-bit compute dtypes are fast on the device training will use, measured as the engine will run
    them: a config asking for a slow one trains, but tens of times slower."""
    device = local_device()
    speeds = [dtype_speed(dtype, device) for dtype in (torch.bfloat16, torch.float16)]
    found = f"on {device.type}: " + ", ".join(
        f"{s.name} {s.slowdown:.1f}x fp32's matmul time ({'slow' if s.slow else 'fast'})" for s in speeds)
    slow = [s.name for s in speeds if s.slow]
    if not slow:
        return Check("compute dtypes", "OK", found)
    fast = [s.name for s in speeds if not s.slow] or ["fp32"]
    return Check("compute dtypes", "WARN", found,
                 f"train in {fast[0]} here (zero.train --dtype {fast[0]}); {' and '.join(slow)} configs are meant "
                 "for a GPU")


def cpu_adam() -> Check:
    choice = kernel_choice()
    if choice.startswith("the C kernel"):
        return Check("cpu-adam", "OK", choice)
    return Check("cpu-adam", "WARN", choice,
                 "`pip install -e .` with a C compiler (gcc) and the Python headers builds ours")


def libaio() -> Check:
    try:
        load_aio()
    except EngineUnavailableError as exc:
        return Check("libaio", "WARN", str(exc),
                     "`pip install -e .` with a C compiler (gcc) and the Python headers builds it; the `threads` "
                     "engine serves meanwhile")
    return Check("libaio", "OK", "tiering._aio is built: engine 'libaio' is available")


def nvme(path: str) -> list[Check]:
    """The path itself, its filesystem, O_DIRECT there and the engine `auto` picks, from a real NvmeStore
    opened and closed on it (its file is empty and removed on close)."""
    path = os.path.abspath(path)
    fix = "pass --nvme-path DIR: an existing directory on a local SSD that this process can write"
    if not os.path.exists(path):
        return [Check("nvme path", "FAIL", f"{path} does not exist", fix)]
    if not os.path.isdir(path):
        return [Check("nvme path", "FAIL", f"{path} is not a directory", fix)]
    fs = os.statvfs(path)
    space = f"{fmt_bytes(fs.f_bavail * fs.f_frsize)} free of {fmt_bytes(fs.f_blocks * fs.f_frsize)}"
    try:
        with warnings.catch_warnings(record=True):  # stale swap files: reported below from store.stale
            with NvmeStore(NvmeStoreConfig(nvme_path=path)) as store:
                direct_io, engine, reason = store.direct_io, store.engine_name, store.engine_reason
                stale = store.stale
    except (TieringError, OSError) as exc:
        return [Check("nvme path", "FAIL", f"{path}, {space}: {exc}", fix)]
    fstype, mount = filesystem(path)
    in_ram = fstype in RAM_FILESYSTEMS
    checks = [Check("nvme path", "OK", f"{path}: a writable directory, {space}")]
    if in_ram:
        checks.append(Check("filesystem", "WARN", f"{fstype} on {mount}: RAM, not a disk, so every byte on the "
                            "nvme tier counts against RAM", "point --nvme-path at a disk filesystem (ext4, xfs)"))
    else:
        checks.append(Check("filesystem", "OK", f"{fstype} on {mount}"))
    if direct_io:
        note = f" ({fstype} accepts it since Linux 6.6, but its pages are RAM)" if in_ram else ""
        checks.append(Check("O_DIRECT", "OK", f"works on {path}{note}"))
    else:
        ram = f"; {fstype} is RAM, so the data counts against RAM" if in_ram else ""
        checks.append(Check("O_DIRECT", "WARN", f"unavailable on {path}: the `auto` engine falls back to "
                            f"`threads`, buffered (page cache){ram}", "use a disk filesystem (ext4, xfs)"))
    checks.append(Check("engine", "OK" if engine == "libaio" else "WARN", reason,
                        "" if engine == "libaio" else "see the libaio and O_DIRECT lines"))
    if stale.worth_telling:
        checks.append(Check("swap files", "WARN", stale.message().splitlines()[0],
                            "a live process's files are left alone; remove the others by hand if they stay"))
    return checks


def memory() -> list[Check]:
    info = meminfo()
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = " / ".join("unlimited" if v == resource.RLIM_INFINITY else fmt_bytes(v) for v in (soft, hard))
    checks = [Check("ram", "OK", f"{fmt_bytes(info['MemTotal'])} total, {fmt_bytes(info['MemAvailable'])} available"),
              Check("memlock", "OK", f"{limit} (soft / hard)")]
    if not torch.cuda.is_available():
        return checks + [Check("pinning", "OK", "no CUDA: nothing to pin")]
    try:
        aligned_empty(PIN_PROBE, pin=True)  # as the host pool pins: its own mapping, registered with CUDA
    except (RuntimeError, TieringError) as exc:
        return checks + [Check("pinning", "FAIL", f"pinning {fmt_bytes(PIN_PROBE)} failed: {exc}",
                               "raise the memlock limit (ulimit -l) or check the CUDA driver")]
    return checks + [Check("pinning", "OK", f"pinned {fmt_bytes(PIN_PROBE)} of host memory")]


def fio() -> Check:
    found = shutil.which("fio")
    if found:
        return Check("fio", "OK", found)
    return Check("fio", "WARN", "not on PATH: bench/tiers.py has no yardstick", "apt-get install fio")


def stripes(paths: list[str]) -> list[Check]:
    """Directories of one nvme_path list that share a device: their files compete for one disk's bandwidth."""
    devices: dict[int, list[str]] = {}
    for path in paths:
        if os.path.isdir(path):
            devices.setdefault(os.stat(path).st_dev, []).append(path)
    shared = [group for group in devices.values() if len(group) > 1]
    if not shared:
        return [Check("stripes", "OK", f"{len(paths)} directories on {len(devices)} devices")] if len(paths) > 1 else []
    return [Check("stripes", "WARN", "; ".join(f"{', '.join(group)} share one device" for group in shared)
                  + ": striping over them adds no bandwidth", "give one directory per SSD")]


def run_checks(nvme_path: str | list[str]) -> list[Check]:
    """Every check; with a list of directories (an nvme_path striped over several), the nvme ones for each."""
    paths = [nvme_path] if isinstance(nvme_path, str) else list(nvme_path)
    return [*python_torch(), compute_dtypes(), cpu_adam(), libaio(), *(c for path in paths for c in nvme(path)),
            *stripes(paths), *memory(), fio()]
