"""Optimizer throughput: one AdamW step over a flat fp32 tensor, in params per second, side by side.

Measured in one run, on the same tensors: ours (zero.optim.adam_math.adam_step), torch.optim.AdamW fused and
foreach, and DeepSpeed's DeepSpeedCPUAdam when `deepspeed` imports (never a dependency of ours). Each size
is allocated once and touched before timing (fresh memory runs near 1 GB/s on this VM), and every optimizer
steps those same buffers: torch's and DeepSpeed's state is pointed at them. With copy-out, each step also
leaves the updated params in a bf16 (or fp16) tensor: ours in the same pass, the others by a copy after
their step. Thread counts: torch.set_num_threads for every system, set once outside the timed steps (torch's
and DeepSpeed's pools follow it), and an AdamThreads of that many threads for ours. The machine is shared and
noisy, so the optimizers are timed in a rotating order, `--steps` times each after a warm-up step, and the
median is kept.

    python3 bench/adam.py                         # 10M, 100M, 500M params; several minutes, ~10 GB RAM
    python3 bench/adam.py --quick                 # seconds; what the test suite runs
    DS_ACCELERATOR=cpu python3 bench/adam.py --sizes 100M --threads 2 --json adam.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the checkout's zero/, also when not installed
from zero.optim.adam_math import AdamThreads, adam_step, kernel_choice  # noqa: E402
from zero.optim.compact_step import compact_choice, compact_step, int8_path, int8_paths  # noqa: E402
from zero.optim.state_format import StateFormat  # noqa: E402

IMPLS = ("ours", "torch-fused", "torch-foreach", "deepspeed", "ours-bf16", "ours-int8")
"""ours-bf16 and ours-int8: our step with the moments stored compact (fp32 master), zero.optim.compact_step.
ours-int8@PATH (PATH one of compact_step.int8_paths()): ours-int8 with its codecs run that way, so that the ways
compare side by side; plain ours-int8 runs the one chosen at import."""
BYTES_PER_PARAM = 28
"""Adam's memory traffic: reads param, grad, exp_avg, exp_avg_sq; writes param, exp_avg, exp_avg_sq."""
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
DEFAULTS = dict(sizes="10M,100M,500M", threads="1,2", steps=7)
QUICK = dict(sizes="50K,1.1M", threads="1,2", steps=2)
OUT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Buffers:
    """One size's tensors, allocated and touched once, stepped by every optimizer in turn."""

    def __init__(self, numel: int, out_dtype: torch.dtype):
        gen = torch.Generator().manual_seed(0)
        self.param = torch.randn(numel, generator=gen)
        self.grad = torch.randn(numel, generator=gen)
        self.exp_avg = torch.zeros(numel)
        self.exp_avg_sq = torch.zeros(numel)
        self.out = torch.zeros(numel, dtype=out_dtype)


def ours(buf: Buffers, threads: AdamThreads, copy_out: bool) -> Callable[[], None]:
    step = 0
    beta1, beta2 = HYPER["betas"]

    def run() -> None:
        nonlocal step
        step += 1
        adam_step(buf.param, buf.grad, buf.exp_avg, buf.exp_avg_sq, step=step, lr=HYPER["lr"], beta1=beta1,
                  beta2=beta2, eps=HYPER["eps"], weight_decay=HYPER["weight_decay"],
                  out=buf.out if copy_out else None, threads=threads)
    return run


def ours_compact(moments: str, path: str | None = None) -> Callable[[Buffers, AdamThreads, bool], Callable[[], None]]:
    """Our step with the moments stored as `moments` (their own buffers; param and grad shared), its int8 codecs
    run as `path` says (compact_step.int8_path)."""
    def make(buf: Buffers, threads: AdamThreads, copy_out: bool) -> Callable[[], None]:
        numel = buf.param.numel()
        codecs = StateFormat(moments, "fp32").codecs(numel)
        m, v = (torch.zeros(c.storage_numel(numel), dtype=c.dtype) for c in (codecs.exp_avg, codecs.exp_avg_sq))
        step = 0
        beta1, beta2 = HYPER["betas"]

        def run() -> None:
            nonlocal step
            step += 1
            if path is not None:
                int8_path(path)
            compact_step(buf.param, buf.grad, m, v, codecs=codecs, numel=numel, out=buf.out if copy_out else None,
                         key=step, index=0, threads=threads,
                         hyper=dict(step=step, lr=HYPER["lr"], beta1=beta1, beta2=beta2, eps=HYPER["eps"],
                                    weight_decay=HYPER["weight_decay"], decoupled=True, grad_scale=1.0))
        return run
    return make


def torch_adamw(kind: str) -> Callable[[Buffers, int, bool], Callable[[], None]]:
    def make(buf: Buffers, threads: AdamThreads, copy_out: bool) -> Callable[[], None]:
        param = torch.nn.Parameter(buf.param)  # shares buf.param's memory
        param.grad = buf.grad
        opt = torch.optim.AdamW([param], **HYPER, **{kind: True})
        opt.state[param] = {"step": torch.zeros((), dtype=torch.float32), "exp_avg": buf.exp_avg,
                            "exp_avg_sq": buf.exp_avg_sq}
        return with_copy_out(opt.step, buf if copy_out else None)
    return make


def deepspeed_adam(buf: Buffers, threads: AdamThreads, copy_out: bool) -> Callable[[], None]:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param = torch.nn.Parameter(buf.param)
    param.grad = buf.grad
    opt = DeepSpeedCPUAdam([param], adamw_mode=True, **HYPER)
    opt.state[param] = {"step": 0, "exp_avg": buf.exp_avg, "exp_avg_sq": buf.exp_avg_sq}
    return with_copy_out(opt.step, buf if copy_out else None)


def with_copy_out(step: Callable[[], object], copy_to: Buffers | None) -> Callable[[], None]:
    """`step`, then the copy-out when `copy_to` is given (torch's intra-op pool is set by `measure`, outside
    the timed region)."""
    def run() -> None:
        step()
        if copy_to is not None:
            copy_to.out.copy_(copy_to.param)
    return run


def maker(impl: str) -> Callable[[Buffers, AdamThreads, bool], Callable[[], None]]:
    if impl.startswith("ours-int8@"):
        return ours_compact("int8", impl.split("@", 1)[1])
    return MAKERS[impl]


MAKERS = {"ours": ours, "torch-fused": torch_adamw("fused"), "torch-foreach": torch_adamw("foreach"),
          "deepspeed": deepspeed_adam, "ours-bf16": ours_compact("bf16"), "ours-int8": ours_compact("int8")}


def deepspeed_note() -> str | None:
    """Why DeepSpeedCPUAdam cannot be measured here, or None when it can (its op builds on first use)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(16))])
    except Exception as e:  # noqa: BLE001  (any failure to import or build means: not measured)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def measure(numel: int, impls: list[str], threads: list[int], steps: int,
            out_dtype: torch.dtype) -> tuple[list[dict], dict[tuple, float]]:
    """The records, and per (params, threads, copy_out) the median over rounds of (best torch time in the
    round / ours in the round): pairs taken close together, so the machine's slow swings cancel."""
    buf = Buffers(numel, out_dtype)
    records, paired = [], {}
    before = torch.get_num_threads()
    for t in threads:
        torch.set_num_threads(t)  # every system's intra-op pool, set outside the timed region
        workers = AdamThreads(t)  # ours runs on these
        for copy_out in (False, True):
            runs = {impl: maker(impl)(buf, workers, copy_out) for impl in impls}
            times: dict[str, list[float]] = {impl: [] for impl in impls}
            for run in runs.values():
                run()  # warm-up: state creation, DeepSpeed's first call, caches
            for i in range(steps):
                order = impls[i % len(impls):] + impls[:i % len(impls)]
                for impl in order:
                    start = time.perf_counter()
                    runs[impl]()
                    times[impl].append(time.perf_counter() - start)
            for impl in impls:
                records.append({"impl": impl, "params": numel, "threads": t, "copy_out": copy_out,
                                "params_per_s": numel / statistics.median(times[impl])})
            paired[(numel, t, copy_out)] = statistics.median(
                min(fused, foreach) / mine
                for fused, foreach, mine in zip(times["torch-fused"], times["torch-foreach"], times["ours"]))
            print(f"  measured {numel} params, {t} threads, copy_out={copy_out}", file=sys.stderr)
        workers.close()
    torch.set_num_threads(before)
    return records, paired


def print_table(records: list[dict], paired: dict[tuple, float], out_name: str) -> None:
    impls = list(dict.fromkeys(r["impl"] for r in records))
    rate = {(r["impl"], r["params"], r["threads"], r["copy_out"]): r["params_per_s"] for r in records}
    print(f"| params | threads | copy-out | {' | '.join(impls)} | ours / best torch | paired | ours GB/s |")
    print("|---" * (len(impls) + 6) + "|")
    for params, t, copy_out in sorted({k[1:] for k in rate}):
        cells = [f"{rate[(i, params, t, copy_out)] / 1e6:.0f}" for i in impls]
        best_torch = max(rate[(i, params, t, copy_out)] for i in ("torch-fused", "torch-foreach"))
        gbps = rate[("ours", params, t, copy_out)] * (BYTES_PER_PARAM + 2 * copy_out) / 1e9
        print(f"| {params / 1e6:g}M | {t} | {out_name if copy_out else 'no'} | {' | '.join(cells)} | "
              f"{rate[('ours', params, t, copy_out)] / best_torch:.2f}x | {paired[(params, t, copy_out)]:.2f}x | "
              f"{gbps:.1f} |")
    for impl in (i for i in impls if i.startswith("ours-")):
        ratios = ", ".join(f"{params / 1e6:g}M x{t}{' copy-out' if copy_out else ''} "
                           f"{rate[(impl, params, t, copy_out)] / rate[('ours', params, t, copy_out)]:.2f}x"
                           for params, t, copy_out in sorted({k[1:] for k in rate}))
        print(f"{impl} (moments {impl[5:].split('@')[0]}, one pass) / ours (exact): {ratios}")
    print(f"\nMparams/s, median of timed steps. paired: median over rounds of best torch time / ours, each round "
          f"timing every optimizer once.\nGB/s counts {BYTES_PER_PARAM} B/param (+2 with copy-out).")


def parse_count(text: str) -> int:
    units = {"K": 10**3, "M": 10**6, "G": 10**9}
    text = text.strip().upper()
    try:
        return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count like 500K, 100M or 1G") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"seconds, for the test suite: {QUICK}")
    parser.add_argument("--sizes", help=f"params per step, a list ({DEFAULTS['sizes']})")
    parser.add_argument("--threads", help=f"thread counts, a list ({DEFAULTS['threads']})")
    parser.add_argument("--steps", type=int, help=f"timed steps per optimizer, median kept ({DEFAULTS['steps']})")
    parser.add_argument("--impls", help=f"optimizers to measure ({','.join(IMPLS)}; with --quick, all but "
                        "deepspeed, whose import and op load alone take ~10 s)")
    parser.add_argument("--out-dtype", choices=sorted(OUT_DTYPES), default="bf16", help="copy-out dtype")
    parser.add_argument("--json", help="write the records here, a JSON list")
    args = parser.parse_args(argv)
    chosen = QUICK if args.quick else DEFAULTS
    args.sizes = [parse_count(s) for s in (args.sizes or chosen["sizes"]).split(",")]
    args.threads = [int(t) for t in (args.threads or chosen["threads"]).split(",")]
    args.steps = args.steps or chosen["steps"]
    args.impls = [i.strip() for i in (args.impls or ",".join(IMPLS[:3] if args.quick else IMPLS)).split(",")
                  if i.strip()]
    paths = [f"ours-int8@{path}" for path in int8_paths()]
    if unknown := set(args.impls) - set(IMPLS) - set(paths):
        parser.error(f"unknown impls {sorted(unknown)}: choose from {', '.join(IMPLS + tuple(paths))}")
    if not {"ours", "torch-fused", "torch-foreach"} <= set(args.impls):
        parser.error("--impls must include ours, torch-fused and torch-foreach (the table compares them)")
    if args.steps < 1 or min(args.threads) < 1 or min(args.sizes) < 1:
        parser.error("--steps, --threads and --sizes must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    impls = list(args.impls)
    if "deepspeed" in impls and (note := deepspeed_note()):
        print(f"note: DeepSpeedCPUAdam not measured ({note})", file=sys.stderr)
        impls.remove("deepspeed")
    print(f"note: {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.backends.cpu.get_cpu_capability()}", file=sys.stderr)
    print(f"note: ours runs {kernel_choice()}", file=sys.stderr)
    if any(impl.startswith("ours-") for impl in impls):
        print(f"note: ours-bf16 and ours-int8 run {compact_choice()}", file=sys.stderr)
        if "ours-int8" in impls and int8_paths():  # the kernel's path, named, since others may change it
            impls[impls.index("ours-int8")] = f"ours-int8@{int8_path()}"
    records, paired = [], {}
    for numel in args.sizes:
        size_records, size_paired = measure(numel, impls, args.threads, args.steps, OUT_DTYPES[args.out_dtype])
        records += size_records
        paired.update(size_paired)
    print_table(records, paired, args.out_dtype)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
