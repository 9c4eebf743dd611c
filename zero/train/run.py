"""The main job: train a GPT-style language model whose training state does not fit the device budget.

    python -m zero.train                              # built-in default: about a minute on a 2-core CPU
    python -m zero.train --config configs/zero3_nvme.json --preset 124m --steps 100 --data my.txt
    torchrun --nproc_per_node 2 -m zero.train         # two data-parallel ranks (gloo on CPU); rank 0 reports

The model is built on the meta device and materialized unit by unit straight into the tiers. Data: the
given text files, or the bytes of this Python's standard library sources, whose last 5% are held out: the
loss on one held-out batch is printed before and after training. Each step prints loss, tokens/s and a
summary: compute, I/O, stall and optimizer time, overlap, bytes per tier pair: under a progress bar on a
terminal, one flushed line a step in a log. A compute dtype slow on this device (fp16 on most CPUs) is named
before training and replaced by a fast one unless --dtype asks for it.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace

import torch
from tqdm import tqdm

from tiering.disk_busy import DiskBusy
from tiering.errors import fmt_bytes

from ..checkpoint.format import CheckpointMismatchError, CheckpointNotFoundError, read_manifest
from ..cli import add_common_flags
from ..comm import local_device
from ..services.compute_speed import NAMES, SlowComputeWarning, dtype_speed, fast_alternative, slow_dtype_line
from ..config import ConfigError, read_json
from ..config.precision import BF16Config, FP16Config
from ..config.scheduler import SCHEDULES, WarmupLRParams
from ..initialize import initialize
from .checks import check_paths
from .corpus import Batches, default_corpus, split_held_out, text_files
from .gpt import GPT, PRESETS, GPTConfig

MiB = 1 << 20
DTYPES = {name: dtype for dtype, name in NAMES.items()}

DEFAULT_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                 "warmup_num_steps": 10, "warmup_type": "linear"}},
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": "/tmp/zero_tiering_nvme"},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/zero_tiering_nvme"},
        "stage3_param_persistence_threshold": 0,
        "sub_group_size": 1_000_000,
    },
    "zero_tiering": {"device_budget": "64MiB", "host_budget": "256MiB"},
}
"""Built-in default: ZeRO-3 with parameters and optimizer state on nvme, a device budget (64 MiB) under the model's
fp32 parameters (73 MiB) plus its gathered units, so offload does real work, and above what the engine needs on
one rank or two in fp32 (49.6 and 48.5 MiB with 1M-element sub-groups: tests/test_shipped_budgets.py)."""


@dataclass
class StepReport:
    step: int
    loss: float
    step_s: float
    forward_backward_s: float
    optimizer_s: float
    stall_s: float
    io_s: float
    bytes_moved: dict
    activations: dict | None = None
    """The activations the step's forwards handed to the swap manager: count and bytes (activation_offload);
    None without."""
    speculation: dict | None = None
    """The step's sub-groups stepped early, rolled back and re-stepped, and the bytes the roll backs restored
    (zero_tiering.speculative_step); None where the step is serial."""
    params: int = 0
    """The model's parameters: what bytes_per_param divides by."""
    schedule: str | None = None
    """How the step's micro-batches ran (engine.schedule: "unit-major" or "micro-batch"); None for one."""
    frozen_read: int = 0
    """Of the bytes read from nvme, those of frozen parameters (an adapter's base: read, never written)."""
    disk_busy_s: float | None = None
    """The time the busiest nvme device had a request in flight, by the kernel's count (tiering/disk_busy.py: io_s's
    lanes also count a transfer's time queued in our engine); None where the device is not known."""

    @property
    def bytes_per_param(self) -> float:
        """Bytes read from and written to nvme this step, per parameter: what sets a disk-bound step."""
        disk = sum(n for pair, n in self.bytes_moved.items() if "nvme" in pair)
        return disk / self.params if self.params else 0.0

    @property
    def compute_s(self) -> float:
        """Time the step spent working rather than waiting for bytes."""
        return self.step_s - self.stall_s

    @property
    def overlap(self) -> float:
        """Share of the I/O time hidden behind compute."""
        return 1.0 - min(self.stall_s, self.io_s) / self.io_s if self.io_s else 1.0


@dataclass
class TrainRun:
    reports: list[StepReport]
    held_out_before: float
    """Loss on the held-out batch before the first step, and after the last."""
    held_out_after: float


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m zero.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="DeepSpeed-format JSON (default: the built-in ZeRO-3 nvme config)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--layers", type=int, help="override the preset's layer count")
    parser.add_argument("--hidden", type=int, help="override the preset's width")
    parser.add_argument("--heads", type=int, help="override the preset's head count")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=steps_arg, default=30,
                        help="optimizer steps (0: the held-out loss alone, of a fresh or a resumed model)")
    parser.add_argument("--data", nargs="*", help="text files (default: the Python standard library's sources)")
    parser.add_argument("--nvme-path", nargs="+", metavar="DIR",
                        help="override every nvme_path in the config; several directories (one per SSD) spread "
                             "the nvme tier over them")
    parser.add_argument("--device-budget", help="override zero_tiering.device_budget (e.g. 64MiB)")
    parser.add_argument("--host-budget", help="override zero_tiering.host_budget")
    parser.add_argument("--trace", help="write a Chrome trace (Perfetto) of the run here")
    parser.add_argument("--summary-json", help="write the per-step reports here")
    parser.add_argument("--lr", type=float,
                        help="peak learning rate: the optimizer's lr and, for WarmupLR and WarmupDecayLR, the "
                             "warmup's top (warmup_max_lr; WarmupCosineLR's peak is the lr itself)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", default="checkpoints",
                        help="where checkpoints go: on SIGTERM or SIGUSR1 (a scheduler's warning) one is saved at the "
                             "next step boundary and the job exits 0; and every --save-every steps. One that holds "
                             "another run's (a `latest`) is refused unless --resume continues it")
    parser.add_argument("--save-every", type=steps_arg, default=0, metavar="N",
                        help="save a checkpoint every N steps (0: only on a signal)")
    parser.add_argument("--resume", metavar="auto|DIR",
                        help="continue from the latest checkpoint in DIR (auto: in --save-dir, starting afresh "
                             "where there is none yet)")
    add_common_flags(parser)
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block in the backward, keeping only its input (torch.utils.checkpoint)")
    parser.add_argument("--activation-offload", choices=["none", "device", "cpu", "nvme"],
                        help="where the activations autograd keeps rest until the backward (zero_tiering."
                             "activation_offload; 'device' keeps them there, counted in the device budget); cpu, "
                             "nvme and device turn --activation-checkpointing on")
    parser.add_argument("--accumulation", choices=["unit-major", "micro-batch"],
                        help="with gradient_accumulation_steps above 1 (zero_tiering.accumulation; default "
                             "unit-major): unit-major runs a step's micro-batches through each block at once (each "
                             "block gathered once a step each way), micro-batch one after another")
    parser.add_argument("--moments", choices=["fp32", "bf16", "int8"],
                        help="how the Adam moments are stored (zero_tiering.moments): fp32 is exact; bf16 and int8 "
                             "(block-wise) move fewer bytes a step at a measured price in loss")
    parser.add_argument("--master", choices=["fp32", "bf16", "bf16-sr", "bf16-kahan"],
                        help="how the master weights are stored (zero_tiering.master): fp32 is exact; bf16 rounds "
                             "each update to nearest, bf16-sr stochastically, bf16-kahan keeps what rounding drops in "
                             "a bf16 compensation; all compute in bf16")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="compute dtype, overriding the config's bf16/fp16 sections (default: the config's, "
                             "unless it is slow on this device: then bf16 or fp32, with a line saying so)")
    return parser.parse_args(argv)


def steps_arg(text: str) -> int:
    """A count of steps, 0 or more (argparse prefixes the flag to the message)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of steps, 0 or more")
    return value


SECTIONS = ("bf16", "bfloat16", "fp16", "optimizer", "optimizer.params", "scheduler", "scheduler.params",
            "zero_optimization", "zero_optimization.offload_param", "zero_optimization.offload_optimizer",
            "zero_tiering")
"""The sections this job reads or sets before load_config sees the config (parents before their children)."""


def load_ds_config(args: argparse.Namespace) -> dict:
    """The config the job runs: --config (read as load_config reads it) or the built-in one, with the flags
    applied. A section set to null is absent, as DeepSpeed reads it."""
    config = read_json(args.config) if args.config else copy.deepcopy(DEFAULT_CONFIG)
    for path in SECTIONS:
        *parents, key = path.split(".")
        parent = functools.reduce(lambda section, name: section.get(name, {}), parents, config)
        if key in parent and parent[key] is None:
            del parent[key]
        elif not isinstance(parent.get(key, {}), dict):
            raise ConfigError(path, "expected an object ({...})", value=parent[key])
    zo = config.setdefault("zero_optimization", {})
    for section in ("offload_param", "offload_optimizer"):
        offload = zo.get(section)
        if offload and offload.get("device") == "nvme":
            if args.nvme_path:
                offload["nvme_path"] = args.nvme_path[0] if len(args.nvme_path) == 1 else args.nvme_path
            paths = offload.get("nvme_path")
            if not paths:
                raise ConfigError(f"zero_optimization.{section}.nvme_path", 'required when device is "nvme": a '
                                  "directory on a local SSD (or give --nvme-path)")
            for path in [paths] if isinstance(paths, str) else paths if isinstance(paths, list) else []:
                if isinstance(path, str) and path:  # (anything else load_config names)
                    make_dir("--nvme-path" if args.nvme_path else f"zero_optimization.{section}.nvme_path", path)
    if args.lr is not None:
        config.setdefault("optimizer", {"type": "AdamW"}).setdefault("params", {})["lr"] = args.lr
        scheduler = config.get("scheduler", {})
        kind = scheduler.get("type")
        if isinstance(kind, str) and issubclass(SCHEDULES.get(kind, object), WarmupLRParams):
            scheduler.setdefault("params", {})["warmup_max_lr"] = args.lr  # (WarmupCosineLR's peak is the lr)
    tiering = config.setdefault("zero_tiering", {})
    if args.device_budget:
        tiering["device_budget"] = args.device_budget
    if args.host_budget:
        tiering["host_budget"] = args.host_budget
    if args.trace:
        tiering["trace_path"] = args.trace
    if args.activation_offload:
        tiering["activation_offload"] = args.activation_offload
    for flag in ("moments", "master", "accumulation"):
        if getattr(args, flag):
            tiering[flag] = getattr(args, flag)
    for name, section in (("bf16", BF16Config), ("bfloat16", BF16Config), ("fp16", FP16Config)):
        if name in config:  # checked as load_config checks it, before anything reads or sets `enabled`
            section.from_json(config[name], name, [])
    if args.dtype:
        set_dtype(config, DTYPES[args.dtype])
    return config


def make_dir(what: str, path: str) -> None:
    """Make the directory `path` (`what` names where it was given), or say in one line why not."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"{what} {path!r} is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise type(err)(f"{what} {path!r}: cannot make the directory: {err.strerror or err}") from None


def config_dtype(config: dict) -> torch.dtype:
    """The compute dtype a DeepSpeed config asks for (`bfloat16` is bf16's old name; a null section is absent)."""
    bf16 = config.get("bf16")
    if _enabled(config.get("bfloat16") if bf16 is None else bf16):
        return torch.bfloat16
    return torch.float16 if _enabled(config.get("fp16")) else torch.float32


def _enabled(section: object) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled"))


def set_dtype(config: dict, dtype: torch.dtype) -> None:
    """Turn the config's precision sections to `dtype`, keeping their other settings (the fp16 loss scale)."""
    config.pop("bfloat16", None)
    config.setdefault("bf16", {})["enabled"] = dtype == torch.bfloat16
    config.setdefault("fp16", {})["enabled"] = dtype == torch.float16


def fast_compute(config: dict, args: argparse.Namespace, device: torch.device) -> str | None:
    """Where the config's compute dtype is slow on `device` and --dtype did not ask for it, switch the config to
    a fast one. Returns the line that says so (or that --dtype keeps the slow one), None where the dtype is fast."""
    speed = dtype_speed(config_dtype(config), device)
    if not speed.slow:
        return None
    instead = fast_alternative(device)
    asked = f"--dtype {args.dtype}" if args.dtype else args.config or "the built-in config"
    line = slow_dtype_line(speed, device, instead, asked)
    if args.dtype:
        return line + "; kept, as --dtype asks"
    master = config.get("zero_tiering", {}).get("master")
    if master is None and config.get("bf16", {}).get("bf16_master_weights_and_grads"):
        master = "bf16"  # DeepSpeed's key for it
    if master not in (None, "fp32") and speed.name == "bf16":
        return line + f"; kept: a {master} master is the bf16 parameter itself"
    set_dtype(config, instead)
    return line + f"; training in {NAMES[instead]} (--dtype {speed.name} keeps {speed.name})"


def model_config(args: argparse.Namespace) -> GPTConfig:
    base = PRESETS[args.preset]
    overrides = {"seq_len": args.seq_len}
    for flag, field in (("layers", "n_layer"), ("hidden", "n_embd"), ("heads", "n_head")):
        if getattr(args, flag) is not None:
            overrides[field] = getattr(args, flag)
    return replace(base, **overrides)


def main(argv: list[str] | None = None) -> TrainRun:
    args = parse_args(argv)
    check_paths(args)
    torch.manual_seed(args.seed)
    config = load_ds_config(args)
    gpt_config = model_config(args)
    tokens, held = split_held_out(text_files(args.data) if args.data else default_corpus(), gpt_config.seq_len)
    with torch.device("meta"):
        model = GPT(gpt_config)
    if args.activation_checkpointing or args.activation_offload not in (None, "none"):
        model.gradient_checkpointing_enable()
    compute_line = fast_compute(config, args, local_device())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowComputeWarning)  # the line above says it, once
        engine, _, _, _ = initialize(model=model, config=config)
    micro = engine.config.train_micro_batch_size_per_gpu
    batches = Batches(tokens, micro, gpt_config.seq_len, args.seed + engine.dp.rank)  # each rank its own data
    held_batch = Batches(held, micro, gpt_config.seq_len, args.seed).next()
    main_rank = engine.dp.rank == 0  # under torchrun, rank 0 alone reports
    say = functools.partial(print, flush=True) if main_rank else (lambda *args, **kwargs: None)
    reports, held_before, held_after, swap = [], None, None, engine.swap
    try:  # whatever ends the run (the last step, a preemption's exit, an error) closes the engine
        first = resume(engine, batches, args)

        def data_state() -> dict:
            return {"batches": batches.generator.get_state()}  # where the data stream is, for a resume

        engine.save_on_signal(args.save_dir, client_state=data_state)
        if compute_line:
            say(compute_line)
        say(f"model: {gpt_config.params / 1e6:.1f}M parameters, {gpt_config.n_layer} layers x {gpt_config.n_embd}; "
            f"training state {fmt_bytes(16 * gpt_config.params)} exact (fp32 master + Adam + grads), stored as "
            f"{engine.driver.state_format.describe()}, "
            f"stage {engine.stage}, compute {str(engine.compute_dtype).removeprefix('torch.')}"
            + (f" (autocast {str(engine.autocast.dtype).removeprefix('torch.')})" if engine.autocast else ""))
        say(f"tiers: device budget {fmt_bytes(swap.device_tier.budget) if swap.device_tier.budget else 'unlimited'}"
            f" on {engine.device}, host budget {fmt_bytes(swap.pool.budget)}"
            + (f", nvme {swap.store.path} ({swap.store.engine_reason})" if swap.store else ""))
        if model.gradient_checkpointing:
            say(f"activations: each block recomputed in the backward, its input "
                f"({fmt_bytes(micro * gpt_config.seq_len * gpt_config.n_embd * engine.compute_dtype.itemsize)}) "
                + {"none": "kept by autograd", "device": "kept on the device, counted in its budget",
                   "host": "offloaded to host memory", "nvme": "offloaded to nvme"}[
                    "none" if engine.activations is None else engine.activations.home])
        held_before = held_out_loss(engine, held_batch)
        tokens_per_step = engine.config.train_batch_size * gpt_config.seq_len
        # A progress bar on a terminal; in a log (stdout not a terminal) its redraws would interleave with the
        # step lines, so there each step is one flushed line and nothing else.
        bar = tqdm(range(first, args.steps), unit="step", file=sys.stdout, dynamic_ncols=True,
                   disable=not (main_rank and sys.stdout.isatty()))
        disk = DiskBusy(swap.config.nvme.directories) if swap.config.nvme is not None else None
        for step in bar:
            reports.append(train_step(engine, batches, step, gpt_config.params, disk))
            report = reports[-1]
            bar.set_postfix_str(
                f"loss {report.loss:.3f} | {tokens_per_step / report.step_s:,.0f} tok/s | "
                f"device {fmt_bytes(swap.device_tier.in_use)} host {fmt_bytes(swap.pool.in_use)}"
                + (f" nvme {fmt_bytes(swap.store.used_bytes)}" if swap.store else ""))
            if main_rank:
                if bar.disable:
                    say(summary_line(report))
                else:
                    tqdm.write(summary_line(report))
            if args.save_every and (step + 1) % args.save_every == 0:
                say(f"checkpoint: {engine.save_checkpoint(args.save_dir, client_state=data_state())}")
        held_after = held_out_loss(engine, held_batch)
        since = "before training" if first == 0 else f"at step {first} (resumed)"
        say(f"held-out loss: {held_before:.4f} {since}, {held_after:.4f} after {args.steps} steps")
    finally:
        if args.summary_json and main_rank:
            with open(args.summary_json, "w") as f:
                json.dump({"held_out_loss": [held_before, held_after], "device_peak_bytes": swap.device_tier.peak,
                           "steps": [vars(r) | {"compute_s": r.compute_s, "overlap": r.overlap,
                                                "bytes_per_param": r.bytes_per_param} for r in reports]},
                          f, indent=1)
        engine.close()  # writes the Chrome trace when zero_tiering.trace_path is set
    if args.trace:
        say(f"Chrome trace: {args.trace}")
    return TrainRun(reports, held_before, held_after)


def resume(engine, batches: Batches, args: argparse.Namespace) -> int:
    """Load the checkpoint --resume names, if any, with the data stream where it was; the first step to run."""
    if not args.resume:
        return 0
    load_dir = args.save_dir if args.resume == "auto" else args.resume
    if args.resume == "auto" and not os.path.exists(os.path.join(load_dir, "latest")):
        return 0  # nothing saved yet: the first run of a job that may be preempted
    path, state = engine.load_checkpoint(load_dir, load_rng_states=True)  # a resume draws as the run would have
    if path is None:
        raise CheckpointNotFoundError(load_dir, "no `latest` there to resume from")
    if not isinstance(state, dict) or "batches" not in state:
        raise CheckpointMismatchError(f"checkpoint {path!r} holds no data position (not saved by zero.train): load "
                                      "it with engine.load_checkpoint in a script of your own")
    saved_world = read_manifest(path)["world_size"]
    note = ""
    if saved_world == engine.dp.world_size:
        batches.generator.set_state(state["batches"])
    else:  # each rank saved its own stream; a rank of another world would repeat rank 0's: a stream of its own
        batches.generator.manual_seed(stream_seed(args.seed, engine.dp.rank, engine.global_steps))
        note = (f" (saved by {saved_world} ranks, resumed on {engine.dp.world_size}: each rank's data stream starts "
                "afresh from the seed, its rank and the step)")
    if engine.dp.rank == 0:
        print(f"resumed from {path} at step {engine.global_steps}{note}", flush=True)
    return engine.global_steps


def stream_seed(seed: int, rank: int, step: int) -> int:
    """A data stream's seed for `rank` resuming at `step` in another world size: one of its own for each rank."""
    return ((seed * 1_000_003 + rank) * 1_000_003 + step) % 2**63


def held_out_loss(engine, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    """The loss on a fixed held-out batch, without gradients."""
    inputs, targets = batch
    with torch.no_grad():
        loss = engine(inputs.to(engine.device), targets.to(engine.device)).item()
    engine.swap.end_step()  # its fetches are no part of a training step's trace
    return loss


def train_step(engine, batches: Batches, step: int, params: int, disk: DiskBusy | None = None) -> StepReport:
    swap = engine.swap
    stall0, moved0, frozen0 = swap.stats.stall_seconds, dict(swap.stats.bytes_moved), frozen_read(engine)
    bets0 = None if engine.speculation is None else asdict(engine.speculation.stats)
    saved0 = None if engine.activations is None else (engine.activations.saved, engine.activations.saved_bytes)
    busy0 = disk.read() if disk is not None else None
    start = time.perf_counter()
    accumulation = engine.gradient_accumulation_steps()
    # One call for the step: its micro-batches through each block at once where the engine can (train_batch).
    micro_batches = [tuple(t.to(engine.device) for t in batches.next()) for _ in range(accumulation)]
    with swap.compute(f"step {step}"):
        loss = engine.train_batch(micro_batches).item()
    end = time.perf_counter()
    busy1 = disk.read() if disk is not None else None
    middle = end - engine.optimizer_seconds
    io = swap.timeline.busy_seconds("nvme->host", "host->nvme", since=start)  # a transfer under way, either way
    moved = {pair: n - moved0.get(pair, 0) for pair, n in swap.stats.bytes_moved.items()}
    bets = None if bets0 is None else {key: n - bets0[key]
                                       for key, n in asdict(engine.speculation.stats).items()}
    return StepReport(step=step, params=params, loss=loss, step_s=end - start,
                      schedule=engine.schedule if accumulation > 1 else None,
                      forward_backward_s=middle - start, optimizer_s=end - middle,
                      stall_s=swap.stats.stall_seconds - stall0, io_s=io, bytes_moved=moved, speculation=bets,
                      frozen_read=frozen_read(engine) - frozen0, disk_busy_s=DiskBusy.busiest(busy0, busy1),
                      activations=None if saved0 is None else {
                          "count": engine.activations.saved - saved0[0],
                          "bytes": engine.activations.saved_bytes - saved0[1]})


def frozen_read(engine) -> int:
    """Bytes of the engine's frozen units read from nvme so far."""
    read = engine.swap.stats.segment_bytes["nvme->host"]
    return sum(read.get(unit.segment, 0) for unit in engine.units if unit.frozen)


def summary_line(r: StepReport) -> str:
    moved = ", ".join(f"{pair} {fmt_bytes(n)}" for pair, n in sorted(r.bytes_moved.items()) if n)
    schedule = "" if r.schedule is None else f" {r.schedule}"
    return (f"step {r.step}: loss {r.loss:.4f} | {r.step_s:.2f} s (fwd+bwd{schedule} {r.forward_backward_s:.2f}, "
            f"optimizer {r.optimizer_s:.2f}) | compute {r.compute_s:.2f} s, I/O {r.io_s:.2f} s"
            + ("" if r.disk_busy_s is None else f" (disk busy {r.disk_busy_s:.2f} s)")
            + f", stall {r.stall_s:.2f} s, overlap {100 * r.overlap:.0f}% | {moved}"
            + (f" ({r.bytes_per_param:.1f} B/param)" if r.bytes_per_param else "")
            + (f", frozen read {fmt_bytes(r.frozen_read)}" if r.frozen_read else "") + (
                "" if r.activations is None else
                f" | activations {r.activations['count']} ({fmt_bytes(r.activations['bytes'])})") + (
                "" if r.speculation is None else
                f" | early {r.speculation['stepped_early']}, rolled back {r.speculation['rolled_back']}, re-stepped "
                f"{r.speculation['re_stepped']} ({fmt_bytes(r.speculation['rollback_bytes'])} restored)"))
