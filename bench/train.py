"""End-to-end training, side by side: plain PyTorch + AdamW (in memory), ours with cpu offload, ours with nvme
offload, and DeepSpeed with the same ds_config when deepspeed is installed (a comparison only, never a
dependency). Same model (zero.train.gpt), same data, same batches; each system runs in its own process so its peak
RSS is its own.

    python bench/train.py [--quick] [--preset 124m] [--layers N] [--steps 5] [--json PATH] [--png PATH]

Per system: median step time over the measured steps (after warm-up), tokens/s, peak RSS, peak device memory
(the device tier's accounting; torch.cuda.max_memory_allocated under CUDA), compute seconds per step (each
measured step's time less its own stall), I/O seconds (the union of the nvme lanes' busy time), bytes moved per
tier pair, and the bytes each process read from and wrote to storage (/proc/self/io: every system's own I/O).
DeepSpeed's step is not split into compute and I/O (n/a); each of ours is compared with DeepSpeed's step on the
same offload device, `-overlap` variants (zero_tiering.overlap_step) and `-int8` / `-bf16` ones (compact moments)
included. With `--dtype bf16` every system computes in bf16 (the config's bf16 section); `-sr` adds a bf16 master
updated with stochastic rounding (ours-nvme-int8-sr: the smallest state we have), and `deepspeed-...-bf16states` is
DeepSpeed with its compact state on (bf16 moments, master and gradients: `bf16_optimizer_states`, which it accepts
only with `bf16_master_weights_and_grads`).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

from scratch import scratch_dir  # noqa: E402


DEVICE_BUDGET = "512MiB"
"""Ours at 124m in fp32 needs 426 MiB of it (the tied embedding gathered and its gradient through the backward, a
block and its gradient, the reduction's scratch: zero.initialize.device_need); below the model's 16-bit size and
its training state. tests/test_shipped_budgets.py checks it."""
QUICK_DEVICE_BUDGET = "1MiB"


def ds_config(offload: str, nvme_path: str, micro_batch: int, lr: float = 1e-4, accumulation: int = 1) -> dict:
    """The ds_config every system reads: ZeRO-3 with params and optimizer offloaded to `offload`."""
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": offload},
            "offload_optimizer": {"device": offload},
            "stage3_param_persistence_threshold": 0,
            "sub_group_size": 10_000_000,
        },
    }
    if offload == "nvme":
        for section in ("offload_param", "offload_optimizer"):
            config["zero_optimization"][section]["nvme_path"] = nvme_path
        config["aio"] = {"block_size": 8 << 20, "queue_depth": 8, "single_submit": False, "overlap_events": True}
    return config


def disk_bytes() -> dict[str, int]:
    """Bytes this process has read from and written to storage (/proc/self/io), whatever system moves them:
    every record carries its own I/O, DeepSpeed's and plain torch's included."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return {"read": int(fields["read_bytes"]), "write": int(fields["write_bytes"])}


def segment_kinds(stats) -> dict[str, int]:
    """Bytes each tier pair has moved so far by segment kind (a segment name's last part: param, master, exp_avg,
    grad...): which state a step's disk bytes are."""
    totals: dict[str, int] = {}
    for pair, segments in stats.segment_bytes.items():
        for name, nbytes in segments.items():
            key = f"{pair} {name.rsplit('/', 1)[-1]}"
            totals[key] = totals.get(key, 0) + nbytes
    return totals


def child(args: argparse.Namespace) -> dict:
    """Run one system in this process and return its record."""
    import torch

    from zero.train.corpus import Batches, default_corpus
    from zero.train.gpt import GPT, PRESETS
    from dataclasses import replace

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    gpt = replace(PRESETS[args.preset], seq_len=args.seq_len)
    if args.layers:
        gpt = replace(gpt, n_layer=args.layers)
    batches = Batches(default_corpus(8 << 20), args.micro_batch, gpt.seq_len, seed=0)
    config = json.loads(args.config_json)
    system = args.child
    moved: dict = {}
    io_s = []
    # Every system computes on the GPU where there is one: inputs go to the device, peaks come from torch.cuda.
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def next_batch():
        return tuple(t.to(device, non_blocking=True) for t in batches.next())

    accumulation = config["gradient_accumulation_steps"]
    if system == "torch":
        model = GPT(gpt).to(device, torch.bfloat16 if config.get("bf16", {}).get("enabled") else torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

        def step() -> None:
            for _ in range(accumulation):
                inputs, targets = next_batch()
                (model(inputs, targets) / accumulation).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    elif system.startswith("ours"):
        import zero

        with torch.device("meta"):
            model = GPT(gpt)
        config.setdefault("zero_tiering", {})["device_budget"] = args.device_budget
        if args.host_budget:
            config["zero_tiering"]["host_budget"] = args.host_budget
        config["zero_tiering"]["overlap_step"] = "-overlap" in system
        if "-microbatch" in system:  # a step's micro-batches one after another, not unit-major
            config["zero_tiering"]["accumulation"] = "micro-batch"
        for moments in ("int8", "bf16"):  # a compact state format: ours-nvme-int8, ours-cpu-bf16
            if f"-{moments}" in system:
                config["zero_tiering"]["moments"] = moments
        if system.endswith("-sr"):
            config["zero_tiering"]["master"] = "bf16-sr"
        engine, _, _, _ = zero.initialize(model=model, config=config)
        swap = engine.swap

        def step() -> None:
            micro_batches = [next_batch() for _ in range(accumulation)]
            start = time.perf_counter()
            engine.train_batch(micro_batches)  # unit-major with accumulation, where the config has it so
            io_s.append(swap.timeline.busy_seconds("nvme->host", "host->nvme", since=start))

    else:
        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's CPU accelerator, set before it picks one
        import deepspeed

        config.pop("zero_tiering", None)
        if "nvme_path" in config["zero_optimization"]["offload_param"]:
            # its nvme parameter buffers must hold the largest parameter (the 1b preset's embedding has 103M
            # elements, over its default 1e8); ours ignore the key
            with torch.device("meta"):
                largest = max(p.numel() for p in GPT(gpt).parameters())
            config["zero_optimization"]["offload_param"]["buffer_size"] = max(100_000_000, largest)
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = GPT(gpt)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def step() -> None:
            for _ in range(accumulation):
                inputs, targets = next_batch()
                engine.backward(engine(inputs, targets))
                engine.step()

    def device_peak() -> int:
        if device.type == "cuda":
            return torch.cuda.max_memory_allocated(device)
        return engine.swap.device_tier.peak if system.startswith("ours") else 0  # the rest: host memory, in RSS

    times, computes, disk, kinds = [], [], [], []
    stall = (lambda: engine.swap.stats.stall_seconds) if system.startswith("ours") else (lambda: 0.0)
    by_kind = (lambda: segment_kinds(engine.swap.stats)) if system.startswith("ours") else dict
    for i in range(args.warmup + args.steps):
        stall0, disk0, kinds0, start = stall(), disk_bytes(), by_kind(), time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        if i >= args.warmup:  # each measured step's own compute: its time less its own stall
            times.append(elapsed)
            computes.append(elapsed - (stall() - stall0))
            disk.append({key: value - disk0[key] for key, value in disk_bytes().items()})
            kinds.append({key: value - kinds0.get(key, 0) for key, value in by_kind().items()})
    if system.startswith("ours"):
        moved = dict(engine.swap.stats.bytes_moved)
        engine.close()
    step_s = statistics.median(times)
    # Ours splits its step into compute and nvme time; torch in memory does no I/O; DeepSpeed's split is
    # unmeasured (its bytes are in disk_bytes).
    compute_s = statistics.median(computes) if not system.startswith("deepspeed") else None
    io = statistics.median(io_s[args.warmup:]) if io_s[args.warmup:] else 0.0 if system == "torch" else None
    return {
        "system": system,
        "params": gpt.params,
        "step_s": step_s,
        "tokens_per_s": accumulation * args.micro_batch * gpt.seq_len / step_s,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_device_bytes": device_peak(),
        "compute_s": compute_s,
        "io_s": io,
        "disk_bytes": {key: statistics.median(d[key] for d in disk) for key in disk[0]},
        "bytes_moved": moved,
        "segment_kinds": {key: statistics.median(k.get(key, 0) for k in kinds) for key in kinds[-1]},
        "steps": times,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, two steps, no DeepSpeed")
    parser.add_argument("--preset", default="124m")
    parser.add_argument("--layers", type=int, default=0, help="the preset's blocks (0: the preset's own)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=1,
                        help="gradient_accumulation_steps: a step is this many micro-batches (ours: train_batch, "
                             "unit-major; ours-...-microbatch: one after another)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="every system's compute dtype")
    parser.add_argument("--systems", default="torch,ours-cpu,ours-nvme,deepspeed-cpu,deepspeed-nvme",
                        help="also ours-cpu-overlap, ours-nvme-overlap: ours with zero_tiering.overlap_step; "
                             "ours-nvme-int8, ours-cpu-bf16 (...): ours with that zero_tiering.moments; "
                             "ours-nvme-microbatch: with --accumulation, micro-batch by micro-batch; with --dtype "
                             "bf16, ours-nvme-int8-sr (int8 moments, a bf16-sr master) and "
                             "deepspeed-nvme-bf16states (its bf16 optimizer states)")
    parser.add_argument("--device-budget", default=DEVICE_BUDGET, help="our device budget (below the model's size)")
    parser.add_argument("--host-budget", default=None,
                        help="our host budget (default: derived from the config); below the training state it streams")
    parser.add_argument("--dir", default=None, help="nvme_path (default: a temporary directory)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--config-json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RECORD " + json.dumps(child(args)))
        return []
    if args.quick:
        args.preset, args.steps, args.warmup, args.seq_len = "tiny", 2, 1, 64
        args.systems = "torch,ours-cpu,ours-nvme"
        args.device_budget = QUICK_DEVICE_BUDGET
    have_deepspeed = importlib.util.find_spec("deepspeed") is not None  # imported in its children only
    records = []
    with scratch_dir(parser, args.dir) as nvme_path:
        for system in args.systems.split(","):
            if system.startswith("deepspeed") and not have_deepspeed:
                print(f"{system}: skipped (deepspeed is not installed)")
                continue
            offload = "nvme" if "nvme" in system else "cpu"
            config = ds_config(offload, nvme_path, args.micro_batch, accumulation=args.accumulation)
            if args.dtype == "bf16":
                config["bf16"] = {"enabled": True}
                if system.startswith("deepspeed") and system.endswith("-bf16states"):
                    config["bf16"].update(bf16_optimizer_states=True, bf16_master_weights_and_grads=True)
            record = run_child(args, system, config)
            if record is not None:
                records.append(record)
                print(format_record(record))
    print_table(records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    if args.png and records:
        plot(records, args.png)
    return records


def run_child(args: argparse.Namespace, system: str, config: dict) -> dict | None:
    command = [sys.executable, os.path.abspath(__file__), "--child", system, "--config-json", json.dumps(config),
               "--preset", args.preset, "--layers", str(args.layers), "--seq-len", str(args.seq_len),
               "--micro-batch", str(args.micro_batch),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
               "--device-budget", args.device_budget] + (["--host-budget", args.host_budget] if args.host_budget else [])
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if system.startswith("deepspeed"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    for line in result.stdout.splitlines():
        if line.startswith("RECORD "):
            return json.loads(line[len("RECORD "):])
    tail = "\n".join((result.stdout + result.stderr).splitlines()[-15:])
    print(f"{system}: failed (exit {result.returncode})\n{tail}")
    return None


def format_record(r: dict) -> str:
    return (f"{r['system']:<16} {r['params'] / 1e6:7.1f}M params  step {r['step_s']:7.2f} s  "
            f"{r['tokens_per_s']:8.1f} tok/s  peak RSS {r['peak_rss_bytes'] / 2**30:6.2f} GiB")


def print_table(records: list[dict]) -> None:
    if not records:
        return
    base = {r["system"]: r["step_s"] for r in records}
    print("\n| system | params | step s | tokens/s | peak RSS GiB | compute s | I/O s | disk read / written GB "
          "| step vs deepspeed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in records:
        # ours-<offload>[-overlap] against deepspeed-<offload>
        ds = base.get("deepspeed-" + r["system"].split("-")[1]) if r["system"].startswith("ours") else None
        ratio = f"{r['step_s'] / ds:.2f}x" if ds else ""
        compute, io = (f"{r[key]:.2f}" if r[key] is not None else "n/a" for key in ("compute_s", "io_s"))
        disk = r["disk_bytes"]
        print(f"| {r['system']} | {r['params'] / 1e6:.1f}M | {r['step_s']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{r['peak_rss_bytes'] / 2**30:.2f} | {compute} | {io} | {disk['read'] / 1e9:.2f} / "
              f"{disk['write'] / 1e9:.2f} | {ratio} |")


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["system"] for r in records]
    a.bar(names, [r["step_s"] for r in records])
    a.set_ylabel("seconds per step")
    b.bar(names, [r["peak_rss_bytes"] / 2**30 for r in records])
    b.set_ylabel("peak RSS (GiB)")
    for axis in (a, b):
        axis.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main(sys.argv[1:])
