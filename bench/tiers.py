"""Tier bandwidth profiler: how fast bytes move between each pair of tiers this machine has.

host<->nvme is measured through NvmeStore for each engine (libaio, threads), beside an aiofiles path (a
candidate engine) and fio (the yardstick: same file size, block size, queue depth, O_DIRECT). device<->host
(pageable and pinned) is measured where CUDA is present. Each axis (block size, queue depth, transfer size)
is swept with the other two held at a reference value. The machine is shared and noisy, so every target is
timed `--reps` times, interleaved with the others in a rotating order, and the median is reported.

Several `--dir`s measure our store striped over all of them (one file, engine and queue per directory), each
transfer cut into `--segments` extents moved at once, as the swap manager keeps several segments in flight;
fio and aiofiles stay on the first directory: one disk, the yardstick the striped store should beat by the
number of disks.

    python3 bench/tiers.py                       # the default sweep, a couple of minutes
    python3 bench/tiers.py --quick               # seconds; what the test suite runs
    python3 bench/tiers.py --size 2GiB --block-sizes 1M,8M --queue-depths 32 --reps 5   # vs fio at scale
    python3 bench/tiers.py --dir /mnt/nvme0 --dir /mnt/nvme1 --segments 4   # a store striped over two disks
    python3 bench/tiers.py --size 1GiB --block-sizes 8M --queue-depths 8 --python-load   # a GIL-bound thread beside

`--python-load` runs a thread of pure Python in this process while every transfer is timed, holding the GIL as a
training thread does (Python, hooks, kernel launches: most of a GPU step): an engine that needs the GIL to keep its
queue full loses its rate; fio, in a process of its own, is the rate without it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from contextlib import nullcontext
from typing import NamedTuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fio import FioFile, fio_binary  # noqa: E402  (bench/ is the script's directory)
from tiering import AioConfig, NvmeStore, NvmeStoreConfig, TieringError, aligned_empty, gather  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
ENGINES = ("libaio", "threads", "aiofiles")
DIRECTIONS = ("write", "read")  # host->nvme, nvme->host
SHOW_ENGINES = ENGINES + ("fio", "pageable", "pinned")  # the order of table rows and plot bars
SHOW_DIRECTIONS = DIRECTIONS + ("h2d", "d2h")
UNITS = {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": 1 << 40}

DEFAULTS = dict(size="64M,256M", block_sizes="128K,512K,1M,8M", queue_depths="1,8,32,64", reps=3)
QUICK = dict(size="16M", block_sizes="256K,1M", queue_depths="8", reps=1)


class Point(NamedTuple):
    size: int
    block_size: int
    queue_depth: int


def parse_size(text: str) -> int:
    """'2GiB', '8M', '128K', '4096' -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 128K, 8MiB or 2GiB")
    return int(match[1]) * UNITS[match[2].upper()]


def parse_list(text: str, parse=parse_size) -> list[int]:
    return sorted({parse(item) for item in text.split(",") if item.strip()})


def short(n: int) -> str:
    """1048576 -> '1M': the compact labels of the table and the plot."""
    for unit in ("T", "G", "M", "K"):
        if n >= UNITS[unit] and n % UNITS[unit] == 0:
            return f"{n // UNITS[unit]}{unit}"
    return str(n)


def nearest(values: list[int], target: int) -> int:
    return min(values, key=lambda v: abs(math.log(v / target)))


def sweep(sizes: list[int], block_sizes: list[int], queue_depths: list[int]) -> list[Point]:
    """Each axis swept with the other two at their reference: the listed block size nearest 1 MiB, the listed
    queue depth nearest 32, the largest size. When at most one list has several values, this is the product."""
    size0, block0, depth0 = max(sizes), nearest(block_sizes, MiB), nearest(queue_depths, 32)
    points = {Point(size0, b, depth0) for b in block_sizes}
    points |= {Point(size0, block0, q) for q in queue_depths}
    points |= {Point(s, block0, depth0) for s in sizes}
    return sorted(points)


def record(pair: str, direction: str, engine: str, point: Point, seconds: float, **layout: int) -> dict:
    """One measurement, in the key names scripts read. pair "host-nvme" (direction "write" or "read"; engine
    libaio, threads, aiofiles or fio; `layout`: dirs, the directories the bytes were spread over, and
    segments, the extents one transfer was cut into) or "device-host" (direction "h2d" or "d2h"; engine
    "pageable" or "pinned"; one copy of the whole size, so block_size = bytes and queue_depth = 1)."""
    return dict(pair=pair, direction=direction, engine=engine, block_size=point.block_size,
                queue_depth=point.queue_depth, bytes=point.size, seconds=seconds, gbps=point.size / seconds / 1e9,
                **layout)


class StoreTarget:
    """`segments` extents of `point.size / segments` bytes in an NvmeStore over `directories` on `engine`,
    written once before anything is timed (the state fio's laid-out file is in). The store places them on
    its files in turn. Each file's engine has its own queue; the threads engine gets `queue_depth` workers:
    its requests in flight."""

    def __init__(self, engine: str, directories: list[str], segments: int, point: Point, buffer: torch.Tensor):
        self.name = engine
        aio = AioConfig(engine=engine, block_size=point.block_size, queue_depth=point.queue_depth,
                        intra_op_parallelism=point.queue_depth)
        part = point.size // segments
        self.store = NvmeStore(NvmeStoreConfig(nvme_path=directories, grow_step=part, aio=aio))
        try:
            self.extents = [self.store.allocate(part, "bench") for _ in range(segments)]
            self.buffers = [buffer[i * part:(i + 1) * part] for i in range(segments)]
            self.run("write")
        except BaseException:
            self.store.close()
            raise

    def run(self, direction: str) -> tuple[float, float]:
        """Wall and process CPU seconds of one transfer of every extent, all started at once."""
        move = self.store.write if direction == "write" else self.store.read
        wall, cpu = time.perf_counter(), time.process_time()
        gather(move(extent, buffer) for extent, buffer in zip(self.extents, self.buffers)).wait()
        return time.perf_counter() - wall, time.process_time() - cpu

    def close(self) -> None:
        self.store.close()


def open_target(name: str, directories: list[str], segments: int, point: Point, buffer: torch.Tensor):
    """fio and aiofiles on the first directory (one disk, one file); our store over all of them."""
    if name == "fio":
        return FioFile(directories[0], point.size, point.block_size, point.queue_depth)
    if name == "aiofiles":
        from aiofiles_path import AiofilesFile  # aiofiles is a bench extra: without it, this path is skipped

        return AiofilesFile(directories[0], point.size, point.block_size, point.queue_depth, buffer)
    return StoreTarget(name, directories, segments, point, buffer)


def layout(name: str, directories: list[str], segments: int) -> dict[str, int]:
    """The `dirs` and `segments` of a host-nvme record (see `record`)."""
    if name in ("fio", "aiofiles"):
        return {"dirs": 1, "segments": 1}
    return {"dirs": len(directories), "segments": segments}


class PythonLoad:
    """A thread running pure Python for as long as the block lasts (see the module's docstring)."""

    def __enter__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, name="bench-python-load")
        self._thread.start()

    def _spin(self) -> None:
        total = 0
        while not self._stop.is_set():
            for i in range(10_000):
                total += i

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure_nvme(directories: list[str], segments: int, points: list[Point], names: list[str],
                 reps: int, python_load: bool = False) -> tuple[list[dict], dict]:
    """Records for host<->nvme, and the median CPU % of each (engine, direction, point) for the table.

    A target that cannot run here (no libaio, no O_DIRECT, no aiofiles, fio failing) is dropped with the
    reason printed, and the rest carry on.
    """
    buffer = aligned_empty(max(p.size for p in points))
    # Random bytes: the virtual disk's host may compress or deduplicate repeated data (fio scrambles its
    # buffers for the same reason); a repeated 1 MiB pattern read and wrote ~15% faster here.
    buffer.view(torch.int64).random_()
    records, cpu = [], {}
    for i, point in enumerate(points, 1):
        began = time.perf_counter()
        targets = []
        try:
            for name in list(names):
                try:
                    targets.append(open_target(name, directories, segments, point, buffer))
                except (TieringError, OSError, RuntimeError, ImportError) as exc:
                    print(f"note: {name} skipped for the rest of the run: {exc}", file=sys.stderr)
                    names.remove(name)
                else:
                    if i == 1 and isinstance(targets[-1], StoreTarget):
                        print(f"note: {name}: {targets[-1].store.engine_reason}", file=sys.stderr)
            if not targets:
                raise SystemExit(f"nothing can be measured in {', '.join(directories)}: see the notes above")
            samples = {(t.name, d): [] for t in targets for d in DIRECTIONS}
            for rep in range(reps):
                order = targets[rep % len(targets):] + targets[: rep % len(targets)]
                for direction in DIRECTIONS:
                    for target in order:
                        with PythonLoad() if python_load else nullcontext():
                            samples[target.name, direction].append(target.run(direction))
        finally:
            for target in targets:
                target.close()
        fio = {d: statistics.median(s for s, _ in samples["fio", d]) for d in DIRECTIONS} if "fio" in names else {}
        for (name, direction), runs in samples.items():
            seconds = statistics.median(s for s, _ in runs)
            rec = record("host-nvme", direction, name, point, seconds, **layout(name, directories, segments))
            if direction in fio and name != "fio":
                rec["fio_gbps"] = point.size / fio[direction] / 1e9
            records.append(rec)
            cpu[name, direction, point] = statistics.median(100 * c / s for s, c in runs)
        print(f"[{i}/{len(points)}] size {short(point.size)} block {short(point.block_size)} "
              f"QD {point.queue_depth}: {time.perf_counter() - began:.1f} s", file=sys.stderr)
    return records, cpu


def measure_device(sizes: list[int], reps: int) -> list[dict]:
    """device<->host copies from pageable and from pinned host memory (one copy of the whole size)."""
    records = []
    for size in sizes:
        point = Point(size, size, 1)
        device = torch.empty(size, dtype=torch.uint8, device="cuda")
        for kind in ("pageable", "pinned"):
            host = torch.ones(size, dtype=torch.uint8, pin_memory=kind == "pinned")
            for direction, dst, src in (("h2d", device, host), ("d2h", host, device)):
                dst.copy_(src, non_blocking=True)  # warm-up: first-touch and driver set-up are not timed
                torch.cuda.synchronize()
                times = []
                for _ in range(reps):
                    began = time.perf_counter()
                    dst.copy_(src, non_blocking=True)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - began)
                records.append(record("device-host", direction, kind, point, statistics.median(times)))
            del host
        del device
    return records


def print_table(records: list[dict], cpu: dict) -> None:
    """A markdown table of our engines with fio's GB/s beside them (fio's own records are in the JSON)."""
    rows = sorted((r for r in records if r["engine"] != "fio"), key=lambda r: (
        r["pair"] != "host-nvme", SHOW_DIRECTIONS.index(r["direction"]), r["bytes"], r["block_size"],
        r["queue_depth"], SHOW_ENGINES.index(r["engine"])))

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print("| pair | direction | engine | dirs | segments | size | block | QD | GB/s | CPU % | fio GB/s | fio CPU % "
          "| x fio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        point = Point(r["bytes"], r["block_size"], r["queue_depth"])
        fio = r.get("fio_gbps")
        cells = [r["pair"], r["direction"], r["engine"], str(r.get("dirs", "-")), str(r.get("segments", "-")),
                 short(r["bytes"]), short(r["block_size"]), str(r["queue_depth"]), fmt(r["gbps"], ".2f"),
                 fmt(cpu.get((r["engine"], r["direction"], point)), ".0f"), fmt(fio, ".2f"),
                 fmt(cpu.get(("fio", r["direction"], point)), ".0f"), fmt(None if fio is None else r["gbps"] / fio, ".2f")]
        print("| " + " | ".join(cells) + " |")


def plot(records: list[dict], path: str) -> None:
    """Grouped bars, one panel per (pair, direction): GB/s of every engine at every measured setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["pair"], r["direction"]) for r in records},
                    key=lambda k: (k[0] != "host-nvme", SHOW_DIRECTIONS.index(k[1])))
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.5 * len(panels)), squeeze=False)
    for ax, (pair, direction) in zip(axes[:, 0], panels):
        mine = [r for r in records if (r["pair"], r["direction"]) == (pair, direction)]
        settings = sorted({(r["bytes"], r["block_size"], r["queue_depth"]) for r in mine})
        engines = sorted({r["engine"] for r in mine}, key=SHOW_ENGINES.index)
        width = 0.8 / len(engines)
        for j, engine in enumerate(engines):
            gbps = {(r["bytes"], r["block_size"], r["queue_depth"]): r["gbps"] for r in mine if r["engine"] == engine}
            ax.bar([i + j * width for i in range(len(settings))], [gbps.get(s, 0) for s in settings], width,
                   label=engine)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(settings))])
        ax.set_xticklabels([f"{short(s)}\nblk {short(b)}\nQD {q}" for s, b, q in settings], fontsize=7)
        ax.set_ylabel("GB/s")
        ax.set_title(f"{pair} {direction}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"seconds, for the test suite: {QUICK}")
    parser.add_argument("--dir", action="append", metavar="DIR",
                        help="directory for the NVMe files (default: a new temp dir under $TMPDIR or /tmp); "
                             "repeated: our store striped over all of them, fio and aiofiles on the first")
    parser.add_argument("--segments", type=int,
                        help="extents each transfer of our store is cut into, moved at once (default: one per --dir)")
    parser.add_argument("--size", help=f"bytes per measurement, a list: the transfer-size axis ({DEFAULTS['size']})")
    parser.add_argument("--block-sizes", help=f"bytes per I/O request ({DEFAULTS['block_sizes']})")
    parser.add_argument("--queue-depths", help=f"requests in flight ({DEFAULTS['queue_depths']})")
    parser.add_argument("--engines", default=",".join(ENGINES), help="NVMe paths to measure (%(default)s)")
    parser.add_argument("--reps", type=int, help=f"timed repetitions per measurement, median kept ({DEFAULTS['reps']})")
    parser.add_argument("--no-fio", action="store_true", help="do not run fio beside our engines")
    parser.add_argument("--python-load", action="store_true",
                        help="a thread of pure Python (holding the GIL) runs while each transfer is timed")
    parser.add_argument("--json", help="write the records here, a JSON list")
    parser.add_argument("--png", help="write a bar plot here")
    args = parser.parse_args(argv)
    chosen = QUICK if args.quick else DEFAULTS
    try:
        args.size = parse_list(args.size or chosen["size"])
        args.block_sizes = parse_list(args.block_sizes or chosen["block_sizes"])
        args.queue_depths = parse_list(args.queue_depths or chosen["queue_depths"], int)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(str(exc))
    args.reps = chosen["reps"] if args.reps is None else args.reps
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if unknown := set(args.engines) - set(ENGINES):
        parser.error(f"unknown engines {sorted(unknown)}: choose from {', '.join(ENGINES)}")
    args.segments = len(args.dir or [None]) if args.segments is None else args.segments
    if min(args.reps, args.segments, *args.size, *args.block_sizes, *args.queue_depths) < 1:
        parser.error("--reps, --segments, --size, --block-sizes and --queue-depths must be positive")
    if any(b % 4096 for b in args.block_sizes) or any(s % b for s in args.size for b in args.block_sizes):
        parser.error("block sizes must be multiples of 4 KiB and every --size a multiple of every block size")
    if any(s % (args.segments * 4096) for s in args.size):
        parser.error(f"every --size must cut into {args.segments} segments of whole 4 KiB blocks")
    for directory in args.dir or []:
        if not os.path.isdir(directory):
            parser.error(f"--dir {directory!r} is not a directory")
    if args.dir and len({os.path.abspath(d) for d in args.dir}) < len(args.dir):
        parser.error(f"--dir names a directory twice: {args.dir}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    names = list(args.engines)
    if args.no_fio:
        print("note: fio not run (--no-fio): no yardstick", file=sys.stderr)
    elif fio_binary():
        names.append("fio")
    else:
        print("note: fio not installed (apt-get install fio): no yardstick", file=sys.stderr)
    directories = args.dir or [tempfile.mkdtemp(prefix="zt-bench-")]
    print(f"note: NVMe files in {', '.join(directories)} ({args.segments} segments per transfer of our store); "
          f"{os.cpu_count()} CPUs; torch {torch.__version__}"
          f"{'; a thread of pure Python beside each transfer' if args.python_load else ''}", file=sys.stderr)
    try:
        records, cpu = measure_nvme(directories, args.segments, sweep(args.size, args.block_sizes, args.queue_depths),
                                    names, args.reps, args.python_load)
    finally:
        if not args.dir:
            os.rmdir(directories[0])
    if torch.cuda.is_available():
        records += measure_device(args.size, args.reps)
    else:
        print("note: no CUDA: device<->host pairs not measured", file=sys.stderr)
    print_table(records, cpu)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    if args.png:
        plot(records, args.png)


if __name__ == "__main__":
    main()
