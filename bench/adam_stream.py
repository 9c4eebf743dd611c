"""CPU-Adam streamed from nvme: an optimizer state of N elements (fp32 master, two moments and the
gradient, 16 B/element) on nvme, stepped by the AdamDriver through the swap manager under a small host
budget, against the I/O bound measured on the same store in the same run.

A step must read 16 B/element (master, moments, gradient) and write back 12 B/element (master, moments), the
reads ahead and the write-backs in flight together: the bound is those 28 B/element over the mixed (read +
write at once) GB/s measured on the same store just before.

    python bench/adam_stream.py [--quick] [--elements 500M] [--json PATH]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch

from tiering import AioConfig, NvmeStoreConfig, SwapConfig, SwapManager, aligned_empty
from zero.optim.driver import AdamDriver

from scratch import scratch_dir  # (bench/ is the script's directory)

MiB = 1 << 20


def parse_count(text: str) -> int:
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1].lower(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def disk_gbps(manager: SwapManager, nbytes: int, chunk: int) -> tuple[float, float, float]:
    """Sequential write, read, and mixed (reading one region while writing another, as a streamed step reads
    ahead while it writes back) GB/s of `nbytes` per direction through the manager's store, in `chunk`-sized
    requests kept several deep (as the driver's prefetch and write-back keep them)."""
    store = manager.store
    count = max(1, nbytes // chunk)
    first, second = ([store.allocate(chunk) for _ in range(count)] for _ in range(2))
    buffers = [aligned_empty(chunk) for _ in range(8)]

    def timed(jobs: list) -> float:
        start, handles = time.perf_counter(), []
        for i, (op, extent) in enumerate(jobs):
            if len(handles) >= len(buffers):
                handles.pop(0).wait()
            handles.append(op(extent, buffers[i % len(buffers)]))
        for handle in handles:
            handle.wait()
        return time.perf_counter() - start

    write_s = timed([(store.write, e) for e in first] + [(store.write, e) for e in second])
    read_s = timed([(store.read, e) for e in first])
    mixed_s = timed([job for pair in zip(((store.read, e) for e in first), ((store.write, e) for e in second))
                     for job in pair])
    for extent in first + second:
        store.free(extent)
    moved = count * chunk
    return 2 * moved / write_s / 1e9, moved / read_s / 1e9, 2 * moved / mixed_s / 1e9


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--elements", default="500M")
    parser.add_argument("--sub-group", default="25M", help="elements per sub-group")
    parser.add_argument("--engine", default="auto", choices=["auto", "libaio", "threads"])
    parser.add_argument("--checksums", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--steps", type=int, default=2, help="measured steps (after one that records the trace)")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.elements, args.sub_group, args.steps = "8M", "1M", 1
    total, per = parse_count(args.elements), parse_count(args.sub_group)
    groups = -(-total // per)
    state_bytes = 16 * per  # one sub-group's four segments
    host_budget = 6 * state_bytes  # the one being updated, the next one read ahead, the last written back
    with scratch_dir(parser, args.dir) as path:
        manager = SwapManager(SwapConfig(
            host_budget=host_budget, nvme=NvmeStoreConfig(nvme_path=path, aio=AioConfig(engine=args.engine)),
            prefetch_bytes=2 * state_bytes, reuse_distance=0, checksums=args.checksums))
        driver = AdamDriver(manager, state_home="nvme", grad_home="nvme", work_tier="host")
        generator = torch.Generator().manual_seed(0)
        for k in range(groups):
            numel = min(per, total - k * per)
            driver.add_unit(k, f"sg{k}", torch.randn(numel, generator=generator), 0, 0)
        write_gbps, read_gbps, mixed_gbps = disk_gbps(manager, min(2 << 30, 4 * state_bytes), min(16 * MiB, 4 * per))
        out = torch.empty(per, dtype=torch.bfloat16)  # the copy-out target, reused

        @contextlib.contextmanager
        def output(sg):
            yield out[: sg.numel]

        hyper = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "decoupled": True}]
        times = []
        gradient = torch.randn(per, generator=generator)  # what a backward pass would leave, reused
        for step in range(1 + args.steps):
            for sg in driver.sub_groups:  # as after backward: every gradient written, and on nvme (untimed)
                driver.accumulate(sg, gradient[: sg.numel])
                manager.evict(sg.segment("grad")).wait()
            start = time.perf_counter()
            driver.step(hyper, step + 1, 1.0, None, output)
            for sg in driver.sub_groups:  # write-backs still in flight are part of the step
                for part in ("master", "exp_avg", "exp_avg_sq"):
                    move = manager.segments[sg.segment(part)].move
                    if move is not None:
                        move.wait()
            manager.end_step()
            if step:
                times.append(time.perf_counter() - start)
            else:  # the first step records the trace; the hit rate is the measured steps'
                manager.stats.hits = manager.stats.misses = 0
        peak_host = manager.stats.peak_bytes["host"]
        hit_rate = manager.stats.hit_rate
        manager.close()
    step_s = statistics.median(times)
    bound = 28 * total / (mixed_gbps * 1e9)
    result = {"elements": total, "sub_group": per, "step_s": step_s, "io_bound_s": bound,
              "fraction_of_bound": bound / step_s, "read_gbps": read_gbps, "write_gbps": write_gbps,
              "mixed_gbps": mixed_gbps,
              "host_budget": host_budget, "peak_host_bytes": peak_host, "hit_rate": hit_rate,
              "checksums": args.checksums}
    print(f"{total / 1e6:.0f}M elements in {groups} sub-groups of {per / 1e6:.0f}M on nvme; disk here: "
          f"read {read_gbps:.2f} GB/s, write {write_gbps:.2f} GB/s, mixed {mixed_gbps:.2f} GB/s")
    print(f"  step {step_s:.2f} s, I/O bound {bound:.2f} s: {bound / step_s:.2f}x the bound; "
          f"host peak {peak_host / MiB:.0f} MiB of a {host_budget / MiB:.0f} MiB budget; hit rate {hit_rate:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
