"""`python -m zero.plan`: will it fit, with which config, and how fast.

    python -m zero.plan --model 1b --layers 4                     # every placement; the fastest that fits
    python -m zero.plan --model path/to/config.json --ram 64GiB --gpu-memory 80GB --out ds_config.json
    python -m zero.plan --model 7b --layers 12 --config configs/zero3_nvme_scale.json   # predict this config

For a model (a preset of the main job, a Hugging Face config.json, or `package.module:function`) and a machine
(RAM, GPU memory, the disk: figures saved by `python -m zero.report --bandwidth PATH`, or given), it prints each
placement's bytes per tier, predicted peak RSS, device peak, nvme bytes per step and step time, and writes the
fastest placement that fits as a ds_config.json. See predict.py for what the predictions count.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from tiering.errors import fmt_bytes

from ..report.bandwidth import DEFAULT_FIGURES, DiskFigures, load_figures
from ..cli import add_common_flags, run_command
from ..comm import local_device
from ..config import load_config, read_json
from ..services.compute_speed import dtype_speed, fast_alternative, slow_dtype_line
from ..optim.state_format import StateFormat
from .machine import (Machine, adam_rate, checksum_rate, compact_adam_rate, directory_problem, gpu_memory, host_ram,
                      matmul_rate, memory_rates, nvme_free, parse_memory)
from .model_source import SEQ_LEN, PlanInputError, load_model
from .predict import (PRECISIONS, Prediction, compact_formats, ds_config, host_budget_for, placement_of, placements,
                      predict)


NVME_DEFAULT = "/tmp/zero_tiering_nvme"
"""The main job's nvme_path (zero/train/run.py), where the README's zero.report --bandwidth measures."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m zero.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a preset, a config.json, or package.module:function")
    parser.add_argument("--layers", type=int, help="override the layer count (of a preset or a config.json)")
    parser.add_argument("--hidden", type=int, help="override the width (of a preset or a config.json)")
    parser.add_argument("--heads", type=int, help="override the head count (of a preset or a config.json)")
    parser.add_argument("--seq-len", type=int, help=f"tokens a sequence (default: the main job's {SEQ_LEN}, or a "
                                                      "config.json's positions where fewer)")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences a micro-batch")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), help="default: bf16 with CUDA, else fp32")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="each block recomputed in the backward (as zero.train's flag)")
    parser.add_argument("--activation-offload", choices=["none", "cpu", "nvme"],
                        help="where the checkpointed activations rest (zero_tiering.activation_offload); cpu and "
                             "nvme turn --activation-checkpointing on; nvme plans only placements with a store")
    parser.add_argument("--moments", choices=["fp32", "bf16", "int8"],
                        help="plan this Adam moments format (zero_tiering.moments); default: exact state, and where "
                             "it fits nowhere, the compact formats too")
    parser.add_argument("--master", choices=["fp32", "bf16", "bf16-sr", "bf16-kahan"],
                        help="plan this master format (zero_tiering.master; bf16 ones need --precision bf16)")
    parser.add_argument("--config", help="predict this DeepSpeed-format config only")
    parser.add_argument("--host-budget", help="zero_tiering.host_budget for --config (as zero.train takes it)")
    parser.add_argument("--device-budget", help="zero_tiering.device_budget for --config")
    parser.add_argument("--ram", help="host memory (default: this machine's)")
    parser.add_argument("--gpu-memory", help="accelerator memory (default: this machine's; 0 without CUDA)")
    parser.add_argument("--disk", default=str(DEFAULT_FIGURES),
                        help="disk figures saved by `python -m zero.report --bandwidth` (default: %(default)s)")
    parser.add_argument("--disk-read", type=float, help="nvme read GB/s (instead of --disk)")
    parser.add_argument("--disk-write", type=float, help="nvme write GB/s (instead of --disk; reading and writing "
                                                           "at once: their harmonic mean in all)")
    parser.add_argument("--nvme-path",
                        help="where nvme placements keep state (default: the directory the saved disk figures were "
                             f"measured in, else {NVME_DEFAULT}; with --config, its own nvme_path counts)")
    parser.add_argument("--out", help="write the chosen placement's ds_config.json here")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    add_common_flags(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = plan(args, current_rss())
    if args.json:
        print(json.dumps(result, indent=1))
    return result


def plan(args: argparse.Namespace, base_rss: int) -> dict:
    shape = load_model(args.model, layers=args.layers, hidden=args.hidden, heads=args.heads, seq_len=args.seq_len)
    disk = disk_figures(args)
    nvme_path, nvme_name = nvme_place(args, disk)
    precision = args.precision or ("bf16" if torch.cuda.is_available() else "fp32")
    if args.config:
        config = given_config(args)
        precision = placement_of(config).precision
    dtype = PRECISIONS[precision]
    device = local_device()
    speed = dtype_speed(dtype, device)
    slow_line = None
    if speed.slow:
        slow_line = slow_dtype_line(speed, device, fast_alternative(device), f"precision {precision}")
    # A slow dtype's rate is fp32's over its measured slowdown: timing its kernels at the model's width takes minutes.
    rate = matmul_rate(shape.hidden, args.micro_batch * shape.seq_len, torch.float32 if speed.slow else dtype)
    asked = None
    if args.moments or args.master:
        asked = StateFormat(args.moments or "fp32", args.master or "fp32")
        if asked.master != "fp32" and precision != "bf16":
            raise PlanInputError(f"--master {asked.master}: a bf16 master needs bf16 compute (--precision bf16)")
    formats = ([placement_of(config).state_format] if args.config else [asked] if asked else
               [StateFormat(), *compact_formats(precision)])
    machine = Machine(
        ram_bytes=parse_memory("--ram", args.ram) if args.ram else host_ram(),
        gpu_bytes=parse_memory("--gpu-memory", args.gpu_memory) if args.gpu_memory else gpu_memory(),
        disk=disk, matmul_flops=rate / (speed.slowdown if speed.slow else 1.0),
        adam_elements=adam_rate(dtype), **dict(zip(("copy_bytes", "fresh_bytes"), memory_rates())),
        checksum_bytes=checksum_rate(),
        compact_adam={fmt: compact_adam_rate(fmt, dtype) for fmt in formats if not fmt.exact})
    free = (nvme_space(nvme_path, nvme_name, config if args.config else None, shape.hidden) if disk is not None
            else None)
    offload = args.activation_offload if args.activation_offload != "none" else None
    if offload == "nvme" and disk is None and not args.config:
        raise PlanInputError("--activation-offload nvme plans placements with a disk, and there are no disk figures: "
                             "run python -m zero.report on the nvme path, or give --disk-read and --disk-write")
    checkpointing = args.activation_checkpointing or offload is not None
    given = placement_of(config) if args.config else None
    if given is not None and disk is None and "nvme" in (given.offload_param, given.offload_optimizer):
        raise PlanInputError(f"{args.config} puts state on nvme, and there are no disk figures to price its I/O: "
                             "run python -m zero.report --bandwidth on the nvme path, or give --disk-read and "
                             "--disk-write")
    if args.config:
        predictions = [predict(shape, machine, config, base_rss, free, checkpointing)]
    else:
        predictions = []
        for fmt in formats:  # exact first; compact formats only where no exact placement fits
            if not fmt.exact and not asked and any(p.fits for p in predictions):
                break
            for placement in placements(precision, nvme=disk is not None, state_format=fmt):
                if offload == "nvme" and "nvme" not in (placement.offload_param, placement.offload_optimizer):
                    continue  # activations on nvme need the store a placement on nvme has
                config = ds_config(placement, micro_batch=args.micro_batch, nvme_path=nvme_path,
                                   activation_offload=offload)
                budget = host_budget_for(shape, machine, config, base_rss, checkpointing)
                if budget is not None:
                    config = ds_config(placement, micro_batch=args.micro_batch, nvme_path=nvme_path,
                                       host_budget=budget, activation_offload=offload)
                predictions.append(predict(shape, machine, config, base_rss, free, checkpointing))
    fitting = [p for p in predictions if p.fits]
    chosen = min(fitting, key=lambda p: (p.step_s, p.peak_rss_bytes)) if fitting else None
    if not args.json:
        if slow_line:
            print(slow_line)
        report(shape, machine, predictions, chosen)
    if chosen is not None and args.out:
        with open(args.out, "w") as f:
            json.dump(chosen.config, f, indent=1)
        if not args.json:
            print(f"wrote {args.out}: python -m zero.train --config {args.out} ...")
    best = chosen or min(predictions, key=lambda p: p.peak_rss_bytes)
    rates = {key: getattr(machine, key) for key in ("ram_bytes", "gpu_bytes", "matmul_flops", "adam_elements",
                                                     "copy_bytes", "fresh_bytes", "checksum_bytes")}
    return {**best.to_json(), "fits": chosen is not None, "explanation": explain(predictions, chosen),
            "model": {"params": shape.params, "layers": shape.layers, "hidden": shape.hidden, "vocab": shape.vocab,
                      "note": shape.note},
            "slow_compute": slow_line,
            "machine": {**rates, "disk": machine.disk and vars(machine.disk)},
            "placements": [p.to_json() for p in predictions]}


def given_config(args: argparse.Namespace) -> dict:
    """--config as load_config reads it (a key twice is an error), with the flags that override its settings."""
    try:
        config = read_json(args.config)
    except OSError as exc:
        raise PlanInputError(f"--config {args.config!r}: {exc}") from exc
    tiering = config.setdefault("zero_tiering", {})
    for flag, key in (("host_budget", "host_budget"), ("device_budget", "device_budget"),
                      ("activation_offload", "activation_offload"), ("moments", "moments"), ("master", "master")):
        if getattr(args, flag):
            tiering[key] = getattr(args, flag)
    if "train_batch_size" not in config and "train_micro_batch_size_per_gpu" not in config:
        config["train_micro_batch_size_per_gpu"] = args.micro_batch  # (given either, DeepSpeed derives the other)
    return config


def nvme_space(nvme_path: str, name: str, config: dict | None, hidden: int) -> int | None:
    """Free bytes where the state on nvme would go: the given config's nvme_path (each directory of a list) where
    it puts state on nvme (None where it puts none there: no directory is asked for), else `nvme_path`
    (nvme_place's, called `name` in an error)."""
    if config is not None:
        zo = load_config(config, hidden_size=hidden).zero_optimization
        for section in ("offload_param", "offload_optimizer"):
            offload = getattr(zo, section)
            if offload.device == "nvme":
                paths = (offload.nvme_path,) if isinstance(offload.nvme_path, str) else offload.nvme_path
                return nvme_free(paths, f"zero_optimization.{section}.nvme_path")
        return None
    return nvme_free([nvme_path], name)


def disk_figures(args: argparse.Namespace) -> DiskFigures | None:
    """The disk's figures: given on the command line, or saved by zero.report; None when neither exists (no
    nvme placement is planned then)."""
    if (args.disk_read is None) != (args.disk_write is None):
        raise PlanInputError("--disk-read and --disk-write go together")
    if args.disk_read is not None:
        for flag, value in (("--disk-read", args.disk_read), ("--disk-write", args.disk_write)):
            if not 0 < value < 1000:
                raise PlanInputError(f"{flag} {value}: GB/s of a disk, between 0 and 1000")
        # Reads and writes at once share the disk's time (the rate zero.report measures as "mixed" was within
        # 0.85-1.45x this harmonic mean and 0.4-0.65x the sum on the machines of bench/RESULTS.md)
        mixed = 2 / (1 / args.disk_read + 1 / args.disk_write)
        return DiskFigures(nvme_path=os.path.abspath(args.nvme_path or NVME_DEFAULT), read_gbps=args.disk_read,
                           write_gbps=args.disk_write, mixed_gbps=mixed, engine="given", measured_at="", bytes=0)
    try:
        return load_figures(args.disk)
    except ValueError as exc:
        raise PlanInputError(str(exc)) from exc


def nvme_place(args: argparse.Namespace, disk: DiskFigures | None) -> tuple[str, str]:
    """Where nvme placements keep state, and its name for an error: --nvme-path; else the directory saved figures
    were measured in (they price that disk, and the user never typed it: a missing one says where it came from and
    how to refresh the figures); else the main job's directory."""
    if args.nvme_path is not None:
        return args.nvme_path, "--nvme-path"
    if disk is None or args.disk_read is not None:
        return NVME_DEFAULT, "the default nvme path (no --nvme-path given)"
    problem = directory_problem(disk.nvme_path)
    if problem and not args.config:
        raise PlanInputError(f"disk figures {args.disk!r} were measured in nvme_path {disk.nvme_path!r}: {problem} "
                             "now; give --nvme-path DIR (a directory on the disk they measured), or measure again with "
                             "python -m zero.report --bandwidth DIR (it saves new figures)")
    return disk.nvme_path, f"the nvme_path of the disk figures {args.disk!r}"


def explain(predictions: list[Prediction], chosen: Prediction | None) -> str:
    if chosen is None:
        tightest = min(predictions, key=lambda p: p.peak_rss_bytes)
        return (f"nothing fits; the smallest, {tightest.placement.name}, needs: {'; '.join(tightest.why_not)}")
    faster = [p for p in predictions if p.step_s < chosen.step_s and not p.fits]
    lines = [f"{chosen.placement.name}: the fastest placement that fits ({chosen.step_s:.2f} s a step, peak RSS "
             f"{fmt_bytes(chosen.peak_rss_bytes)})."]
    fmt = chosen.placement.state_format
    exact = [p for p in predictions if p.placement.state_format.exact]
    if not fmt.exact and exact:
        tightest = min(exact, key=lambda p: p.peak_rss_bytes)
        lines.append(f"Exact fp32 state fits nowhere (the smallest, {tightest.placement.name}: "
                     f"{'; '.join(tightest.why_not)}); {fmt.describe()} stores it in fewer bytes and moves fewer a "
                     "step, at a price in loss measured in bench/RESULTS.md (bench/quality.py), not bit for bit "
                     "torch AdamW.")
    if faster:
        quickest = min(faster, key=lambda p: p.step_s)
        lines.append(f"Faster but not fitting: {quickest.placement.name} ({quickest.step_s:.2f} s): "
                     f"{'; '.join(quickest.why_not)}.")
    if chosen.schedule == "unit-major":
        lines.append("Its micro-batches run unit-major (each block gathered once a step each way, recomputed a "
                     "micro-batch at a time): the device peak holds every block's input for all of them.")
    elif chosen.schedule == "micro-batch":
        lines.append("Its micro-batches run one after another (zero_tiering.accumulation micro-batch, or below "
                     "stage 3): every block is gathered, and its gradient moved, once per micro-batch.")
    if chosen.bytes_per_step:
        lines.append(f"It moves {fmt_bytes(chosen.bytes_per_step)} of nvme I/O a step "
                     f"(optimizer phase {chosen.optimizer_s:.2f} s).")
    return " ".join(lines)


def report(shape, machine: Machine, predictions: list[Prediction], chosen: Prediction | None) -> None:
    print(f"model: {shape.params / 1e6:.1f}M trainable parameters, {shape.layers} layers x {shape.hidden}, "
          f"{shape.seq_len} tokens a sequence" + (f"; {shape.note}" if shape.note else ""))
    disk = (f"disk {machine.disk.read_gbps:.2f} GB/s read, {machine.disk.write_gbps:.2f} write"
            if machine.disk else "no disk figures (run python -m zero.report --bandwidth PATH): no nvme placement")
    compact = ", ".join(f"{fmt.moments}/{fmt.master} {rate / 1e6:.0f}" for fmt, rate in machine.compact_adam.items())
    compact = f" ({compact})" if compact else ""  # the compact formats planned
    print(f"machine: RAM {fmt_bytes(machine.ram_bytes)}, GPU {fmt_bytes(machine.gpu_bytes)}, {disk}; matmul "
          f"{machine.matmul_flops / 1e9:.0f} GFLOP/s, CPU-Adam {machine.adam_elements / 1e6:.0f} M elements/s"
          f"{compact}")
    width = max(len(p.placement.name) for p in predictions)
    print(f"{'placement':<{width}} {'device':>10} {'host':>10} {'nvme':>10} {'peak RSS':>10} {'nvme/step':>10} "
          f"{'step s':>8}  fits")
    for p in predictions:
        t = p.tier_bytes
        print(f"{p.placement.name:<{width}} {fmt_bytes(t['device']):>10} {fmt_bytes(t['host']):>10} "
              f"{fmt_bytes(t['nvme']):>10} {fmt_bytes(p.peak_rss_bytes):>10} {fmt_bytes(p.bytes_per_step):>10} "
              f"{p.step_s:>8.2f}  {'yes' if p.fits else 'no: ' + '; '.join(p.why_not)}")
    print(explain(predictions, chosen))


def current_rss() -> int:
    """This process's resident bytes now (python, torch and zero imported): the floor of a training process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


if __name__ == "__main__":
    run_command("zero.plan", main, errors=(PlanInputError,))
