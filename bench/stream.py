"""The disk in a real training step: ours streaming a model's state through nvme, against the bound measured in
the same run on the same path.

Three measurements, in one run:
1. fio's mixed rate (reads and writes at once, O_DIRECT, 8 MiB blocks, queue depth 32) on the nvme_path, before
   and after the training run (the disk drifts; the bound uses their mean);
2. the same model's step with everything in memory (stage 0, no offload, same precision): the compute;
3. ours with the given config (default: the README's scale config), step by step, once per state format asked
   (--formats: exact fp32 state and compact ones, side by side against the same yardstick).

The config's gradient_clipping decides which step is measured: where it strikes, the step runs after the backward
(serially); where it does not (--gradient-clipping 1e9), the step is speculated inside the backward. The column
"optimizer" says which each step was (early, rolled back, serial).

Per measured step: bytes read and written, realized GB/s against fio's, the disk's idle fraction (1 - the time the
device had a request in flight, by the kernel's count, / the step; where the device is not known, the union of
the nvme lanes' busy time, which also counts a transfer's time queued in our engine: column "lanes idle"), and
step / max(compute, bytes / fio mixed). Medians over the measured steps; the first step against a later one (the
first runs without a trace). Each run is its own process, so peak RSS is its own.

    python bench/stream.py [--quick] [--preset 1b --layers 4 --host-budget 1GiB] [--formats fp32/fp32,int8/fp32]
                           [--gradient-clipping 1e9] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from fio import PAGES, fio_binary, fio_rate, memory as fio_memory  # noqa: E402  (bench/ is the script's directory)
from scratch import scratch_dir  # noqa: E402

GiB = 1 << 30


def train(args: argparse.Namespace, config: dict, summary: str, *, offloaded: bool,
          schedule: str | None = None) -> tuple[dict, int]:
    """Run `python -m zero.train` with `config` in a child process: its summary and its peak RSS in bytes."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(config, f)
    command = [sys.executable, "-m", "zero.train", "--config", f.name, "--preset", args.preset,
               "--steps", str(args.steps), "--summary-json", summary, "--seq-len", str(args.seq_len)]
    if args.layers:
        command += ["--layers", str(args.layers)]
    if args.dtype:
        command += ["--dtype", args.dtype]
    if schedule:
        command += ["--accumulation", schedule]
    if offloaded:
        command += ["--nvme-path", args.dir, "--host-budget", args.host_budget]
        if args.device_budget:
            command += ["--device-budget", args.device_budget]
    try:
        with tempfile.TemporaryFile("w+") as err:
            child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, text=True)
            _, status, usage = os.wait4(child.pid, 0)  # the child's own rusage: its peak RSS alone
            code = os.waitstatus_to_exitcode(status)
            err.seek(0)
            if code:
                raise RuntimeError(f"{' '.join(command)} exited {code}:\n{err.read()[-3000:]}")
    finally:
        os.unlink(f.name)
    with open(summary) as f:
        return json.load(f), usage.ru_maxrss * 1024


def fio_mixed(directory: str, size: int) -> float:
    """fio's mixed read+write rate on `directory`, bytes/s (both directions together)."""
    return fio_rate(directory, size, "rw")


def in_memory(config: dict) -> dict:
    """`config` with everything in memory: stage 0, no offload, the same precision and optimizer."""
    config = json.loads(json.dumps(config))
    config["zero_optimization"] = {"stage": 0}
    config["zero_tiering"] = {"device_budget": "1TiB"}
    return config


def per_step(step: dict, mixed: float, compute: float) -> dict:
    read = step["bytes_moved"].get("nvme->host", 0)
    written = step["bytes_moved"].get("host->nvme", 0)
    moved = read + written
    bound = max(compute, moved / mixed)
    busy = step["io_s"] if step.get("disk_busy_s") is None else step["disk_busy_s"]  # the device's count, if known
    bets = step.get("speculation") or {}
    how = "rolled" if bets.get("rolled_back") else "early" if bets.get("stepped_early") else "serial"
    return {"step": step["step"], "step_s": step["step_s"], "read_bytes": read, "write_bytes": written, "how": how,
            "realized_gbps": moved / step["step_s"] / 1e9, "of_fio": moved / step["step_s"] / mixed,
            "disk_idle": 1 - min(busy, step["step_s"]) / step["step_s"],
            "lanes_idle": 1 - min(step["io_s"], step["step_s"]) / step["step_s"],
            "bound_s": bound, "vs_bound": step["step_s"] / bound}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model, three steps, a small fio file")
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "zero3_nvme_scale.json"))
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the medians (the first included)")
    parser.add_argument("--host-budget", default="1GiB")
    parser.add_argument("--device-budget", help="default: the config's")
    parser.add_argument("--fio-size", default=str(2 * GiB), help="bytes fio reads and writes, per measurement")
    parser.add_argument("--dir", default=None, help="nvme_path (default: a temporary directory)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                        help="the compute dtype, kept even where it is slow (zero.train --dtype; default: the "
                             "config's, or a fast one in its place)")
    parser.add_argument("--formats", default="fp32/fp32",
                        help="state formats to run, comma-separated MOMENTS/MASTER (zero_tiering.moments and .master), "
                             "e.g. fp32/fp32,int8/fp32,int8/bf16-sr")
    parser.add_argument("--schedules", default="unit-major",
                        help="accumulation schedules to run each format with, comma-separated (zero.train "
                             "--accumulation): unit-major,micro-batch; they differ only with gradient accumulation")
    parser.add_argument("--gradient-clipping", type=float, default=None,
                        help="the config's gradient_clipping replaced: e.g. 1e9, on but never striking (the step is "
                             "speculated inside the backward); the scale config's 1.0 strikes at every step of this "
                             "model, and each step then runs serially after the backward (the column 'optimizer' "
                             "says which)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    schedules = args.schedules.split(",")
    if any(s not in ("unit-major", "micro-batch") for s in schedules):
        parser.error(f"--schedules {args.schedules!r}: unit-major and/or micro-batch, comma-separated")
    formats = [tuple(f.split("/")) for f in args.formats.split(",")]
    if any(len(f) != 2 for f in formats):
        parser.error(f"--formats {args.formats!r}: MOMENTS/MASTER pairs, comma-separated (e.g. fp32/fp32,int8/fp32)")
    if args.quick:
        args.preset, args.layers, args.seq_len, args.steps, args.warmup = "tiny", 0, 64, 3, 1
        args.host_budget, args.device_budget, args.fio_size = "2MiB", "4MiB", str(64 << 20)
    if fio_binary() is None:
        raise SystemExit("bench/stream.py needs fio (apt-get install fio): it is the yardstick")
    with open(args.config) as f:
        config = json.load(f)
    if args.gradient_clipping is not None:
        config["gradient_clipping"] = args.gradient_clipping
    with scratch_dir(parser, args.dir) as directory:
        args.dir = directory
        summary = os.path.join(directory, "summary.json")
        mixed_before = fio_mixed(directory, int(args.fio_size))
        memory, memory_rss = train(args, in_memory(config), summary, offloaded=False)
        runs = {}
        for moments, master in formats:
            formatted = json.loads(json.dumps(config))
            formatted.setdefault("zero_tiering", {}).update(moments=moments, master=master)
            for schedule in schedules:
                name = f"{moments}/{master}" + (f" {schedule}" if len(schedules) > 1 else "")
                runs[name] = train(args, formatted, summary, offloaded=True, schedule=schedule)
        mixed_after = fio_mixed(directory, int(args.fio_size))
    mixed = (mixed_before + mixed_after) / 2
    compute = statistics.median(s["step_s"] for s in memory["steps"][args.warmup:])
    result = {
        "model": {"preset": args.preset, "layers": args.layers, "seq_len": args.seq_len, "dtype": args.dtype},
        "gradient_clipping": config.get("gradient_clipping", 0.0),
        "config": os.path.relpath(args.config, ROOT), "host_budget": args.host_budget,
        "fio_mixed_gbps": {"before": mixed_before / 1e9, "after": mixed_after / 1e9}, "fio_memory": fio_memory(),
        "in_memory_step_s": compute, "in_memory_peak_rss_bytes": memory_rss,
        "formats": {name: measured_run(ours, rss, mixed, compute, args.warmup) for name, (ours, rss) in runs.items()},
    }
    print_result(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def measured_run(ours: dict, rss: int, mixed: float, compute: float, warmup: int) -> dict:
    """One format's run: its steps against the bound, their medians, bytes per parameter."""
    steps = [per_step(s, mixed, compute) for s in ours["steps"]]
    measured = steps[warmup:]
    median = {key: statistics.median(s[key] for s in measured)
              for key in ("step_s", "read_bytes", "write_bytes", "realized_gbps", "of_fio", "disk_idle", "lanes_idle",
                          "bound_s", "vs_bound")}
    params = ours["steps"][0]["params"]
    return {"peak_rss_bytes": rss, "params": params, "losses": [s["loss"] for s in ours["steps"]], "steps": steps,
            "median": median, "bytes_per_param": (median["read_bytes"] + median["write_bytes"]) / params,
            "held_out_loss": ours["held_out_loss"],
            "first_vs_later": steps[0]["step_s"] / statistics.median(s["step_s"] for s in steps[1:])}


def print_result(r: dict) -> None:
    fio = r["fio_mixed_gbps"]
    print(f"fio mixed on the nvme_path: {fio['before']:.2f} GB/s before, {fio['after']:.2f} GB/s after "
          f"(its buffers: {PAGES[r['fio_memory']]})")
    print(f"in memory: {r['in_memory_step_s']:.2f} s/step, peak RSS {r['in_memory_peak_rss_bytes'] / GiB:.2f} GiB")
    first = None
    for name, run in r["formats"].items():
        first = first or run
        print(f"state format {name} (moments/master{' schedule' if ' ' in name else ''}): peak RSS {run['peak_rss_bytes'] / GiB:.2f} GiB, "
              f"{run['bytes_per_param']:.1f} bytes per parameter per step, median step "
              f"{run['median']['step_s'] / first['median']['step_s']:.2f}x the first format's")
        print(f"{'step':>4} {'s':>7} {'read GB':>8} {'write GB':>8} {'GB/s':>6} {'of fio':>7} {'idle':>6} "
              f"{'lanes idle':>10} {'bound s':>8} {'vs bound':>8}  "
              f"optimizer (gradient_clipping {r['gradient_clipping']:g})")
        for s in run["steps"] + [dict(run["median"], step="med", how="")]:
            print(f"{s['step']:>4} {s['step_s']:7.2f} {s['read_bytes'] / 1e9:8.2f} {s['write_bytes'] / 1e9:8.2f} "
                  f"{s['realized_gbps']:6.2f} {s['of_fio']:7.2f} {s['disk_idle']:6.0%} "
                  f"{s['lanes_idle']:10.0%} {s['bound_s']:8.2f} "
                  f"{s['vs_bound']:8.2f}  {s['how']}")
        print(f"first step / later steps: {run['first_vs_later']:.2f}")


if __name__ == "__main__":
    main()
