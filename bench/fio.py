"""fio as the yardstick for the NVMe engines: one sequential O_DIRECT libaio job at a time, its bandwidth read
from fio's JSON output, on a file that fio lays out (writes once) before anything is timed.

fio's buffers sit on huge pages where the kernel has enough of them reserved (`echo 300 >
/proc/sys/vm/nr_hugepages`), as ours do (tiering/aligned.py): on 4 KiB pages a block's pages are scattered, the
device's segment limit cuts each 8 MiB block into ~1 MiB requests, and a disk that is request-bound (this VM's
virtio disk: 1.0 GB/s mixed on 4 KiB pages, 3.0 on huge pages, the same minute) looks slower than it is. `memory()`
says which; every bench prints it beside fio's figures."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess

from tiering.aligned import HUGE_PAGE

PAGES = {"shmhuge": "huge pages", "malloc": "4 KiB pages, understating a request-bound disk: see bench/fio.py"}


def memory(block_size: int = 8 << 20, queue_depth: int = 32) -> str:
    """fio's --iomem: "shmhuge" where the free reserved huge pages hold a full queue of blocks, else "malloc"."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        free = int(info["HugePages_Free"].split()[0]) * int(info["Hugepagesize"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return "malloc"
    return "shmhuge" if free >= block_size * queue_depth + HUGE_PAGE else "malloc"


def fio_binary() -> str | None:
    return shutil.which("fio")


class FioFile:
    """A file of `size` bytes in `directory` that fio reads and writes sequentially with O_DIRECT.

    Creating it runs one untimed write job, so every timed job (read or write) meets a fully written file,
    the state our store's extents are in when they are timed. `close()` removes the file.
    """

    name = "fio"

    def __init__(self, directory: str, size: int, block_size: int, queue_depth: int):
        self.binary = fio_binary()
        if self.binary is None:
            raise FileNotFoundError("fio is not installed (apt-get install fio)")
        self.size, self.block_size, self.queue_depth = size, block_size, queue_depth
        self.path = os.path.join(directory, f"zt-bench-{os.getpid()}-{secrets.token_hex(4)}.fio")
        try:
            self.run("write")
        except BaseException:
            self.close()
            raise

    def run(self, direction: str) -> tuple[float, float]:
        """Run one job; the seconds fio measured for its bytes (its own start-up not included) and the CPU
        seconds fio reports it spent in them."""
        args = [
            self.binary, "--name=zt-bench", f"--filename={self.path}", f"--size={self.size}",
            f"--bs={self.block_size}", f"--iodepth={self.queue_depth}", "--ioengine=libaio", "--direct=1",
            f"--rw={direction}", "--numjobs=1", "--output-format=json",
            f"--iomem={memory(self.block_size, self.queue_depth)}",
        ]
        done = subprocess.run(args, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"fio exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
        # fio may print notes before the JSON document on stdout.
        report = json.loads(done.stdout[done.stdout.index("{"):])
        job = report["jobs"][0]
        # A mixed job ("rw": half reads, half writes at once) moves the file's bytes in both directions together.
        sides = ("read", "write") if direction == "rw" else (direction,)
        moved, rate = (sum(job[side][key] for side in sides) for key in ("io_bytes", "bw_bytes"))
        if moved != self.size or rate <= 0:
            raise RuntimeError(f"fio moved {moved} of {self.size} bytes at {rate} B/s ({direction} {self.path})")
        seconds = moved / rate
        return seconds, seconds * (job["usr_cpu"] + job["sys_cpu"]) / 100

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def fio_rate(directory: str, size: int, direction: str) -> float:
    """fio's rate on a fresh `size`-byte file in `directory`, bytes/s: `direction` "read", "write", or "rw" (mixed:
    both directions together); 8 MiB blocks, queue depth 32."""
    file = FioFile(directory, size, 8 << 20, 32)
    try:
        seconds, _ = file.run(direction)
    finally:
        file.close()
    return size / seconds
