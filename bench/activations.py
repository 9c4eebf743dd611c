"""Activation offload: the device tier's peak and the step time with the checkpointed activations kept on the
device (counted in its budget) against offloaded to host memory or nvme, side by side in one run.

Every run but "all" checkpoints each block (torch.utils.checkpoint, non-reentrant), and every run trains the same
batches from the same weights, the head's loss computed in chunks of rows (zero.train.chunked_loss): ZeRO-3,
parameters and optimizer state in host memory (so the step's own I/O is not what is measured), but for mode
"nvme", whose activations need the nvme store: there the optimizer state is on nvme too, so its step is not the
activations' price alone. Modes: "none" (autograd keeps the inputs, uncounted: the step-time yardstick),
"device" (kept on the device and counted: the device-peak yardstick), "cpu" and "nvme" (offloaded; nvme with no
host room set aside for them), "all" (no checkpointing: everything autograd saves kept on the device and
counted; a lower bound, since the views it saves are not counted). The offloaded modes run under a device budget
of --budget-share of the "device" run's peak, so the peak they report is also one they were held to (one that
does not hold is recorded with its error). Without CUDA the device tier is host memory and its copies run on the
copy worker (see tiering/copy_stream); with CUDA the record adds torch.cuda.max_memory_allocated.

    python bench/activations.py [--quick] [--preset 1b --layers 4 --seq-len 4096 --micro 1] [--json PATH]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from dataclasses import replace

import torch

import zero
from tiering.errors import BudgetExceededError, fmt_bytes
from zero.train.gpt import GPT, PRESETS

from scratch import scratch_dir  # (bench/ is the script's directory)

MODES = ("none", "device", "cpu", "nvme")
KEEPS = {"all": "device"}
"""Modes whose activations rest as another mode's do (without checkpointing)."""


def config(args, mode: str, nvme: str, device_budget: int | None) -> dict:
    tiering = {"activation_offload": KEEPS.get(mode, mode)}
    if mode == "nvme":
        tiering["activation_host_bytes"] = 0  # no room set aside on the host: they go through the disk
    if device_budget is not None:
        tiering["device_budget"] = device_budget
    return {
        "train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "bf16": {"enabled": args.dtype == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "offload_param": {"device": "cpu"},
                              "offload_optimizer": {"device": "nvme" if mode == "nvme" else "cpu",
                                                    "nvme_path": nvme}},
        "zero_tiering": tiering,
    }


def run(args, mode: str, nvme: str, device_budget: int | None) -> dict:
    gpt = replace(PRESETS[args.preset], seq_len=args.seq_len, **({"n_layer": args.layers} if args.layers else {}))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(gpt)
    if mode not in KEEPS:
        model.gradient_checkpointing_enable()
    engine, *_ = zero.initialize(model=model, config=config(args, mode, nvme, device_budget))
    cuda = engine.device.type == "cuda"
    generator = torch.Generator().manual_seed(1)
    steps, losses = [], []
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats(engine.device)
        for _ in range(args.steps):
            ids = torch.randint(0, gpt.vocab_size, (args.micro, args.seq_len + 1), generator=generator)
            ids = ids.to(engine.device)
            start = time.perf_counter()
            loss = engine(ids[:, :-1], ids[:, 1:])
            engine.backward(loss)
            engine.step()
            if cuda:
                torch.cuda.synchronize(engine.device)
            steps.append(time.perf_counter() - start)
            losses.append(loss.item())
        stats = engine.swap.stats
        record = {
            "mode": mode, "device_budget": device_budget, "steps_s": steps,
            "step_s": statistics.median(steps[1:] if len(steps) > 1 else steps),
            "losses": losses, "device_peak": stats.peak_bytes["device"], "host_peak": stats.peak_bytes["host"],
            "activations": None if engine.activations is None else engine.activations.saved / args.steps,
            "activation_bytes": None if engine.activations is None else engine.activations.saved_bytes / args.steps,
            "bytes_moved": dict(stats.bytes_moved),
        }
        if cuda:
            record["cuda_max_allocated"] = torch.cuda.max_memory_allocated(engine.device)
        return record
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny preset at 64 tokens (CI)")
    parser.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="steps per mode; the first (no trace yet) is not timed")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--budget-share", type=float, default=0.5,
                        help="the offloaded modes' device budget, as a share of the 'device' mode's peak")
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES + tuple(KEEPS))}")
    parser.add_argument("--dir", help="where the nvme store goes (default: a temporary directory)")
    parser.add_argument("--json", help="write the record here")
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.layers, args.seq_len, args.micro, args.steps = "tiny", 2, 64, 2, 2
        args.budget_share = 1.0  # the tiny model's peak is its units, not its activations
    modes = args.modes.split(",")
    records = {}
    with scratch_dir(parser, args.dir) as nvme:
        for mode in modes:
            budget = None
            if mode in ("cpu", "nvme") and "device" in records:
                budget = int(args.budget_share * records["device"]["device_peak"])
            try:
                records[mode] = run(args, mode, nvme, budget)
            except BudgetExceededError as exc:
                print(f"{mode:>6}: {exc}", flush=True)
                records[mode] = {"mode": mode, "device_budget": budget, "error": str(exc)}
                continue
            finally:
                gc.collect()  # the closed engine and its model (a reference cycle): the next mode needs the memory
            r = records[mode]
            print(f"{mode:>6}: step {r['step_s']:.2f} s, device peak {fmt_bytes(r['device_peak'])}"
                  + (f" (budget {fmt_bytes(budget)})" if budget else "")
                  + ("" if r["activations"] is None else
                     f", {r['activations']:.0f} activations ({fmt_bytes(r['activation_bytes'])}) a step"), flush=True)
    ran = {mode: r for mode, r in records.items() if "error" not in r}
    result = {"args": vars(args), "records": records,
              "losses_identical": len({tuple(r["losses"]) for r in ran.values()}) == 1}
    for base, suffix in (("device", ""), ("all", "_vs_all")):
        if base in ran:
            for mode in ("cpu", "nvme"):
                if mode in ran:
                    result[f"{mode}_peak_ratio{suffix}"] = ran[mode]["device_peak"] / ran[base]["device_peak"]
    if "none" in ran:
        for mode in ("device", "cpu", "nvme"):
            if mode in ran:
                result[f"{mode}_step_ratio"] = ran[mode]["step_s"] / ran["none"]["step_s"]
    print(json.dumps({k: v for k, v in result.items() if k.endswith("ratio") or k == "losses_identical"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
