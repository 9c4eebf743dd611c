"""Compute-transfer overlap: a synthetic step over N segments that live on nvme, with real CPU compute per
segment, run synchronously and with trace-driven prefetch in the same invocation.

Four timings, all in this run: compute alone (segments already resident), I/O alone (fetch every segment,
no compute), the step without prefetch, the step with prefetch. Overlap is good when the prefetched step
is close to max(compute, I/O). The matrix products are sized so compute and I/O take about the same time.

    python bench/overlap.py [--quick] [--json PATH] [--trace PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch

from tiering import AioConfig, NvmeStoreConfig, SwapConfig, SwapManager

from scratch import scratch_dir  # (bench/ is the script's directory)

MiB = 1 << 20


def build(args, prefetch_bytes: int, nvme_path: str) -> SwapManager:
    seg_bytes = args.segment_mib * MiB
    config = SwapConfig(
        host_budget=(args.window + 2) * seg_bytes,
        device_budget=(args.window + 2) * seg_bytes,
        nvme=NvmeStoreConfig(nvme_path=nvme_path, aio=AioConfig(engine=args.engine)),
        prefetch_bytes=prefetch_bytes,
        checksums=args.checksums,
    )
    manager = SwapManager(config)
    side = int((seg_bytes // 4) ** 0.5)
    generator = torch.Generator().manual_seed(0)
    for i in range(args.segments):
        weight = torch.randn(side, side, generator=generator) / side**0.5
        manager.register(f"w{i}", dtype=torch.float32, shape=weight.shape, home="nvme", data=weight).wait()
    return manager


def compute(weight: torch.Tensor, x: torch.Tensor, repeats: int) -> torch.Tensor:
    for _ in range(repeats):
        x = torch.tanh(x @ weight)
    return x


def run_step(manager: SwapManager, args, x: torch.Tensor, repeats: int) -> float:
    """One step: every segment fetched in order, computed on, released clean (like parameters in forward)."""
    start = time.perf_counter()
    for i in range(args.segments):
        weight = manager.acquire(f"w{i}", args.tier)
        with manager.compute(f"w{i}"):
            x = compute(weight, x, repeats)
        manager.release(f"w{i}")
    manager.end_step()
    return time.perf_counter() - start


def pin_compute(cpus: list[int]) -> None:
    """--pin: this thread (the compute: one torch thread) on the first of `cpus`, every other thread of the process
    (the I/O's: the engine's reaper, copy and checksum workers) on the others, so neither takes the other's core."""
    if len(cpus) < 2:
        raise SystemExit(f"--pin needs 2 CPUs, this process has {len(cpus)}")
    me = threading.get_native_id()
    os.sched_setaffinity(me, {cpus[0]})
    for task in os.listdir("/proc/self/task"):
        if int(task) != me:
            os.sched_setaffinity(int(task), set(cpus[1:]))


def io_only(manager: SwapManager, args) -> float:
    """Fetch every segment with nothing else running: the I/O time a step cannot beat."""
    start = time.perf_counter()
    for i in range(args.segments):
        manager.acquire(f"w{i}", args.tier)
        manager.release(f"w{i}")
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--segments", type=int, default=24)
    parser.add_argument("--segment-mib", type=int, default=64)
    parser.add_argument("--window", type=int, default=4, help="segments of prefetch (and budget headroom)")
    parser.add_argument("--tier", choices=["device", "host"], default="device")
    parser.add_argument("--engine", choices=["auto", "libaio", "threads"], default="auto")
    parser.add_argument("--checksums", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--threads", type=int, default=1, help="torch compute threads (the rest serve I/O)")
    parser.add_argument("--pin", action="store_true",
                        help="compute on the first CPU, the I/O's threads on the others (what a core free for the "
                             "I/O gives)")
    parser.add_argument("--repeats", type=int, default=3, help="measured steps per mode (median reported)")
    parser.add_argument("--dir", default=None, help="nvme_path (default: a temporary directory)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--trace", default=None, help="write the prefetched step's Chrome trace here")
    args = parser.parse_args(argv)
    if args.quick:
        args.segments, args.segment_mib, args.repeats = 8, 4, 2
    torch.set_num_threads(args.threads)

    with scratch_dir(parser, args.dir) as nvme_path:
        seg_bytes = args.segment_mib * MiB
        sync = build(args, 0, nvme_path)
        prefetched = build(args, args.window * seg_bytes, nvme_path)
        try:
            side = sync.segments["w0"].shape[0]
            x = torch.randn(64, side)
            cpus = sorted(os.sched_getaffinity(0))
            if args.pin:  # the I/O's threads exist once both managers have fetched
                for manager in (sync, prefetched):
                    run_step(manager, args, x, 1)
                pin_compute(cpus)
            # Calibrate: matmul repeats per segment so compute time matches the I/O time per segment.
            io_s = statistics.median(io_only(sync, args) for _ in range(2))
            weight = torch.randn(side, side)
            compute(weight, x, 2)  # warm-up
            start = time.perf_counter()
            compute(weight, x, 8)
            per_repeat = (time.perf_counter() - start) / 8
            repeats = max(1, round(io_s / args.segments / per_repeat))

            start = time.perf_counter()
            for _ in range(args.segments):
                compute(weight, x, repeats)
            compute_s = time.perf_counter() - start

            for manager in (sync, prefetched):  # the first step records the trace
                run_step(manager, args, x, repeats)
            if args.pin:  # threads started since
                pin_compute(cpus)
            sync_times, prefetch_times, io_times = [], [], [io_s]
            for _ in range(args.repeats):  # interleaved, so drift in the machine hits both modes alike
                sync_times.append(run_step(sync, args, x, repeats))
                prefetched.stats.hits = prefetched.stats.misses = 0
                prefetch_times.append(run_step(prefetched, args, x, repeats))
                io_times.append(io_only(sync, args))
            io_s = statistics.median(io_times)
            result = {
                "compute_s": compute_s,
                "io_s": io_s,
                "step_s_prefetch": statistics.median(prefetch_times),
                "step_s_sync": statistics.median(sync_times),
                "hit_rate": prefetched.stats.hit_rate,
                "segments": args.segments,
                "segment_bytes": seg_bytes,
                "tier": args.tier,
                "engine": prefetched.store.engine_name,
                "checksums": args.checksums,
                "compute_threads": args.threads,
                "pinned": args.pin,
                "stall_s_prefetch": prefetched.stats.stall_seconds,
            }
            if args.trace:
                prefetched.write_chrome_trace(args.trace)
        finally:
            sync.close()
            prefetched.close()

    bound = max(result["compute_s"], result["io_s"])
    print(f"{args.segments} segments x {args.segment_mib} MiB on nvme ({result['engine']}), tier {args.tier}, "
          f"checksums {'on' if args.checksums else 'off'}, {args.threads} compute thread(s)"
          f"{', pinned apart from the I/O' if args.pin else ''}")
    print(f"  compute alone      {result['compute_s']:.3f} s")
    print(f"  I/O alone          {result['io_s']:.3f} s  ({args.segments * seg_bytes / result['io_s'] / 1e9:.2f} GB/s)")
    print(f"  step, synchronous  {result['step_s_sync']:.3f} s  ({result['step_s_sync'] / bound:.2f}x max)")
    print(f"  step, prefetch     {result['step_s_prefetch']:.3f} s  ({result['step_s_prefetch'] / bound:.2f}x max)")
    print(f"  prefetch hit rate  {result['hit_rate']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
