"""What a compact state format costs in loss: the main job's GPT trained on the standard-library corpus with exact
AdamW (our exact state: torch AdamW bit for bit) and with each compact format, the same seed, batches and compute
dtype, against torchao's low-bit AdamW (AdamW8bit; with --torchao-bf16, bf16 weights updated with its stochastic
rounding) trained beside them on the same batches in plain PyTorch.

Our runs go through the engine (ZeRO-3, parameters and state on cpu: the state is stored in the format and stepped
by CPU-Adam). Each run's held-out loss after training is the mean over 8 fixed held-out batches; every format's is
reported relative to exact's with the same seed, and beside the seed-to-seed spread of exact's (--seeds 2 or more).
torchao is needed for its runs only (pip install torchao); it is never a dependency of zero-tiering.

    python bench/quality.py [--quick] [--preset small --steps 300 --batch 8 --lr 1e-3] [--seeds 0,1]
                            [--formats int8/fp32,bf16/fp32] [--torchao] [--plot bench/quality.png] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import replace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import zero  # noqa: E402
from zero.services.compute_speed import SlowComputeWarning  # noqa: E402
from zero.train.corpus import Batches, default_corpus, split_held_out  # noqa: E402
from zero.train.gpt import GPT, PRESETS  # noqa: E402

HELD_OUT_BATCHES = 8


def config(args: argparse.Namespace, moments: str, master: str) -> dict:
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                  "offload_optimizer": {"device": "cpu"}, "sub_group_size": 4_000_000,
                                  "stage3_param_persistence_threshold": 0},
            **({"bf16": {"enabled": True}} if args.dtype == "bf16" else {}),
            "zero_tiering": {"moments": moments, "master": master}}


def data(args: argparse.Namespace, seed: int):
    tokens, held = split_held_out(default_corpus(), args.seq_len)
    held_out = Batches(held, args.batch, args.seq_len, 10_000)
    return Batches(tokens, args.batch, args.seq_len, seed), [held_out.next() for _ in range(HELD_OUT_BATCHES)]


def model(args: argparse.Namespace, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(replace(PRESETS[args.preset], seq_len=args.seq_len))


def held_out_loss(forward, held) -> float:
    with torch.no_grad():
        return statistics.fmean(forward(x, y).item() for x, y in held)


def train_ours(args: argparse.Namespace, seed: int, moments: str, master: str) -> dict:
    batches, held = data(args, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowComputeWarning)
        engine, *_ = zero.initialize(model=model(args, seed), config=config(args, moments, master))
    curve, start = [], time.perf_counter()
    try:
        for _ in range(args.steps):
            x, y = batches.next()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            curve.append(loss.item())
        return {"curve": curve, "held_out": held_out_loss(engine, held), "seconds": time.perf_counter() - start}
    finally:
        engine.close()


def train_torchao(args: argparse.Namespace, seed: int, bf16_weights: bool) -> dict:
    """Plain PyTorch with torchao's AdamW8bit (bf16_weights: the model's weights in bf16, updated with its
    stochastic rounding), the same clipping, hyperparameters and batches."""
    from torchao.optim import AdamW8bit

    batches, held = data(args, seed)
    net = model(args, seed)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if bf16_weights:
        net = net.to(torch.bfloat16)
    optimizer = AdamW8bit(net.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                          bf16_stochastic_round=bf16_weights)
    curve, start = [], time.perf_counter()
    for _ in range(args.steps):
        x, y = batches.next()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32 and not bf16_weights):
            loss = net(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        curve.append(loss.item())
    return {"curve": curve, "held_out": held_out_loss(net, held), "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny preset, a few steps, one seed")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                        help="compute dtype of every run (bf16 masters need bf16)")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--formats", default="int8/fp32,bf16/fp32", help="MOMENTS/MASTER, comma-separated")
    parser.add_argument("--torchao", action="store_true", help="torchao's AdamW8bit beside them")
    parser.add_argument("--torchao-bf16", action="store_true",
                        help="torchao's AdamW8bit with bf16 weights and stochastic rounding beside them")
    parser.add_argument("--plot", help="write the loss curves here (PNG; needs matplotlib)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if any(len(f.split("/")) != 2 for f in args.formats.split(",")):
        parser.error(f"--formats {args.formats!r}: MOMENTS/MASTER pairs, comma-separated (e.g. int8/fp32)")
    if args.quick:
        args.preset, args.steps, args.batch, args.seq_len, args.seeds = "tiny", 4, 2, 32, "0"
    torch.set_num_threads(os.cpu_count() or 1)
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: dict[str, dict[int, dict]] = {}
    for seed in seeds:
        todo = [("exact", lambda: train_ours(args, seed, "fp32", "fp32"))]
        todo += [(fmt, lambda fmt=fmt: train_ours(args, seed, *fmt.split("/"))) for fmt in args.formats.split(",")]
        if args.torchao:
            todo.append(("torchao AdamW8bit", lambda: train_torchao(args, seed, False)))
        if args.torchao_bf16:
            todo.append(("torchao AdamW8bit bf16-sr", lambda: train_torchao(args, seed, True)))
        for name, run in todo:
            runs.setdefault(name, {})[seed] = run()
            print(f"  seed {seed} {name}: held-out {runs[name][seed]['held_out']:.4f} "
                  f"({runs[name][seed]['seconds']:.0f} s)", file=sys.stderr, flush=True)
    exact = {seed: runs["exact"][seed]["held_out"] for seed in seeds}
    result = {"preset": args.preset, "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr,
              "dtype": args.dtype, "seeds": seeds,
              "exact_spread": (max(exact.values()) - min(exact.values())) / statistics.fmean(exact.values()),
              "runs": {name: {str(seed): run for seed, run in by_seed.items()} for name, by_seed in runs.items()}}
    result["relative"] = {name: statistics.fmean(by_seed[seed]["held_out"] / exact[seed] - 1 for seed in seeds)
                          for name, by_seed in runs.items()}
    print(f"{args.preset}, {args.steps} steps, batch {args.batch} x {args.seq_len}, lr {args.lr}, {args.dtype}, "
          f"seeds {seeds}: exact's held-out spread over seeds {100 * result['exact_spread']:.2f}%")
    for name, by_seed in runs.items():
        held = [by_seed[seed]["held_out"] for seed in seeds]
        seconds = statistics.fmean(r["seconds"] for r in by_seed.values())
        print(f"  {name:<28} held-out {' '.join(f'{h:.4f}' for h in held)}  vs exact "
              f"{100 * result['relative'][name]:+.2f}%  ({seconds:.0f} s)")
    if args.plot:
        plot(runs, seeds[0], args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def plot(runs: dict, seed: int, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, by_seed in runs.items():
        curve = by_seed[seed]["curve"]
        window = max(1, len(curve) // 30)
        smooth = [statistics.fmean(curve[max(0, i - window + 1):i + 1]) for i in range(len(curve))]
        ax.plot(smooth, label=f"{name} (held-out {by_seed[seed]['held_out']:.4f})")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (moving mean of {max(1, len(curve) // 30)})")
    ax.set_ylim(top=min(8, max(max(r[seed]["curve"][len(r[seed]["curve"]) // 10:]) for r in runs.values())),
                bottom=min(min(r[seed]["curve"]) for r in runs.values()) - 0.1)
    ax.legend()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
