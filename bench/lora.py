"""LoRA on a base larger than the host budget: the base's frozen weights partitioned onto nvme, read in the forward
and again in the backward, never written; against the disk's read rate measured on the same path in the same run.

The base is Llama-shaped at the 7b preset's width (hidden 4096, MLP 11008, 32 heads, vocab 32000), --layers deep,
built under zero.Init straight onto nvme (never whole in memory), with PEFT's LoRA (r 16) on q, k, v and o;
ZeRO-3 in fp32, parameters on nvme, the adapters' optimizer state on cpu, --seq-len tokens a step (8: the regime a GPU
sees, the disk the bound). Each run in a process of its own (bench/children.py), its peak RSS its own. Measured in one
run:
1. fio's sequential read rate (O_DIRECT, 8 MiB blocks, queue depth 32) on the nvme_path, before and after;
2. the same PEFT model's step in plain PyTorch, everything in memory (the compute), unless --skip-in-memory;
   both compute on the GPU where there is one;
3. ours, step by step: seconds, nvme bytes read (the frozen ones apart) and written, the step against
   max(compute, bytes read / fio's read rate), once per way of storing the base asked (--bases: as computed, fp32,
   bf16 (bf16 compute, the base stored in bf16: half fp32's bytes) and block-wise int8,
   zero_quantized_nontrainable_weights); with int8, the format's effect on the base's logits: the same batch through
   the base with its weights in bf16 and through int8 and back (plain PyTorch, fp32 arithmetic), max |difference|
   over max |bf16 logit| and mean |difference| over mean |bf16 logit|; bf16's own against fp32 for scale.

    python bench/lora.py [--quick] [--layers 4] [--host-budget 1536MiB] [--dir DIR] [--bases fp32,bf16,int8]
                         [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import children  # noqa: E402  (bench/ is the script's directory)
from fio import PAGES, fio_binary, fio_rate, memory as fio_memory  # noqa: E402
from scratch import scratch_dir  # noqa: E402

GiB = 1 << 30
SEVEN_B = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
               vocab_size=32000)
QUICK = dict(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4, vocab_size=256)


def model_config(args: argparse.Namespace):
    from transformers import LlamaConfig

    shape = QUICK if args.quick else SEVEN_B
    return LlamaConfig(num_hidden_layers=args.layers, max_position_embeddings=max(64, args.seq_len), **shape)


def lora(base):
    import peft

    return peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))


BASES = ("fp32", "bf16", "int8")
"""How the base is stored: fp32 as computed, bf16 (the compute dtype bf16 too), int8 (computed in fp32)."""


def engine_config(args: argparse.Namespace, base: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "bf16": {"enabled": base == "bf16"},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": args.dir},
                                  "offload_optimizer": {"device": "cpu"},
                                  # the quick Llama's layers are all below the default persistence threshold
                                  # (1e5 elements): kept gathered, nothing of its base would stream
                                  **({"stage3_param_persistence_threshold": 0} if args.quick else {}),
                                  "zero_quantized_nontrainable_weights": base == "int8"},
            "zero_tiering": {"host_budget": args.host_budget}}


def batch(args: argparse.Namespace, vocab: int, step: int, device=None):
    """Step `step`'s tokens, on `device` (the one computing: a GPU where there is one)."""
    import torch

    generator = torch.Generator().manual_seed(step)
    return torch.randint(0, vocab, (1, args.seq_len), generator=generator).to(device or "cpu")


def synchronized() -> float:
    """time.perf_counter() once the GPU, if any, has done what was queued: a step's seconds are its kernels' too."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def run_ours(args: argparse.Namespace) -> dict:
    """The child: build under zero.Init, apply LoRA, train; one JSON line with every step's figures."""
    import torch
    from transformers import LlamaForCausalLM

    import zero
    from zero.train.run import frozen_read

    torch.manual_seed(0)
    config = engine_config(args, args.base)
    start = time.perf_counter()
    with zero.zero.Init(config_dict_or_path=config):
        base = LlamaForCausalLM(model_config(args))
    model = lora(base)
    engine, *_ = zero.initialize(model=model, config=config,
                                 model_parameters=[p for p in model.parameters() if p.requires_grad])
    built = time.perf_counter() - start
    frozen = [u for u in engine.units if u.frozen]
    frozen_bytes = sum(engine.swap.segments[u.segment].nbytes for u in frozen)
    trained = sum(u.flat.numel for u in engine.units if not u.frozen)
    stats, steps = engine.swap.stats, []
    for step in range(args.steps):
        read0, written0, frozen0 = (stats.bytes_moved.get("nvme->host", 0), stats.bytes_moved.get("host->nvme", 0),
                                    frozen_read(engine))
        frozen_written0 = sum(stats.segment_bytes["host->nvme"].get(u.segment, 0) for u in frozen)
        stall0 = stats.stall_seconds
        ids = batch(args, model.config.vocab_size, step, engine.device)
        t0 = synchronized()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        seconds = synchronized() - t0
        steps.append({"step": step, "s": seconds, "loss": loss.item(), "stall_s": stats.stall_seconds - stall0,
                      "read": stats.bytes_moved.get("nvme->host", 0) - read0,
                      "written": stats.bytes_moved.get("host->nvme", 0) - written0,
                      "frozen_read": frozen_read(engine) - frozen0,
                      "frozen_written": sum(stats.segment_bytes["host->nvme"].get(u.segment, 0)
                                            for u in frozen) - frozen_written0})
    result = {"build_s": built, "frozen_bytes": frozen_bytes, "trained_params": trained,
              "host_budget": engine.swap.pool.budget, "host_peak": stats.peak_bytes.get("host", 0),
              "device_peak": stats.peak_bytes.get("device", 0), "steps": steps}
    engine.close()
    return result


def run_in_memory(args: argparse.Namespace) -> dict:
    """The child: the same PEFT model in plain PyTorch, in memory, computed in fp32 or (base bf16) bf16; torch
    AdamW on the adapters."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = lora(LlamaForCausalLM(model_config(args)))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device, torch.bfloat16 if args.base == "bf16" else None)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    steps = []
    for step in range(args.steps):
        ids = batch(args, model.config.vocab_size, step, device)
        t0 = synchronized()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps.append({"step": step, "s": synchronized() - t0, "loss": loss.item()})
    return {"steps": steps}


def run_logits(args: argparse.Namespace) -> dict:
    """The child: the base's logits on one batch with its frozen weights in bf16 and through int8 and back, both
    computed in fp32 from the same fp32 base."""
    import torch
    from transformers import LlamaForCausalLM

    from zero.comm import DataParallel
    from zero.initialize import plan_units
    from zero.params import int8_weights

    torch.manual_seed(0)
    model = lora(LlamaForCausalLM(model_config(args))).eval()
    ids = batch(args, model.config.vocab_size, 0)
    params = dict(model.named_parameters())
    frozen = [flat for flat, _ in plan_units(model, [{"params": [p for p in params.values() if p.requires_grad]}],
                                             DataParallel(), frozen="layer") if flat.frozen]
    originals = {name: p.detach().clone() for name, p in params.items() if not p.requires_grad}
    logits = {}
    with torch.no_grad():
        logits["fp32"] = model(input_ids=ids).logits.float()
        for name in originals:
            params[name].copy_(originals[name].bfloat16().float())
        logits["bf16"] = model(input_ids=ids).logits.float()
        for name in originals:
            params[name].copy_(originals[name])
        for flat in frozen:
            int8_weights.round_trip(flat, params)
        logits["int8"] = model(input_ids=ids).logits.float()

    def relative(a: torch.Tensor, b: torch.Tensor) -> dict:
        difference = (a - b).abs()
        return {"max_relative": (difference.max() / b.abs().max()).item(),
                "mean_relative": (difference.mean() / b.abs().mean()).item()}

    return {**relative(logits["int8"], logits["bf16"]), "bf16_against_fp32": relative(logits["bf16"], logits["fp32"]),
            "tokens": ids.numel(), "vocab": model.config.vocab_size}


def child(args: argparse.Namespace, role: str, base: str = "fp32") -> tuple[dict, int]:
    """Run `role` (with the base stored as `base`) in a process of its own: its result and its peak RSS in bytes."""
    return children.run(ROLES[role], argparse.Namespace(**{**vars(args), "base": base}))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny Llama, a small fio file (what CI runs)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=8)
    parser.add_argument("--host-budget", default="1536MiB")
    parser.add_argument("--dir", help="where the store and fio's file go, in a temporary folder (default: /tmp)")
    parser.add_argument("--fio-size", default=str(2 * GiB))
    parser.add_argument("--skip-in-memory", action="store_true", help="no in-memory yardstick (the base whole in RAM)")
    parser.add_argument("--bases", default="fp32",
                        help="how the base is stored, one run each: fp32 (as computed), bf16 (computed in bf16), "
                             "int8 (and its effect on the logits)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.steps, args.host_budget, args.fio_size = 3, 3, "1MiB", str(64 << 20)
    if fio_binary() is None:
        raise SystemExit("bench/lora.py needs fio (apt-get install fio): it is the yardstick")
    with scratch_dir(parser, args.dir) as directory:
        args.dir = directory
        before = fio_rate(directory, int(args.fio_size), "read")
        bases = args.bases.split(",")
        if not set(bases) <= set(BASES):
            raise SystemExit(f"--bases {args.bases}: some of {', '.join(BASES)}")
        memory = {compute: child(args, "in-memory", compute)  # compute dtype -> (result, peak RSS)
                  for compute in ([] if args.skip_in_memory else sorted({computed(base) for base in bases}))}
        runs = {base: child(args, "ours", base) for base in bases}
        after = fio_rate(directory, int(args.fio_size), "read")
    rate = (before + after) / 2
    step = {compute: statistics.median(s["s"] for s in result["steps"][1:]) for compute, (result, _) in memory.items()}
    result = {"fio_read_gbps": {"before": before / 1e9, "after": after / 1e9}, "fio_memory": fio_memory(),
              "layers": args.layers, "seq_len": args.seq_len, "in_memory_step_s": step,
              "in_memory_peak_rss_bytes": {compute: rss for compute, (_, rss) in memory.items()},
              "runs": {name: measured_run(ours, rss, step.get(computed(name), 0.0), rate)
                       for name, (ours, rss) in runs.items()}}
    if "int8" in runs:
        result["int8_logits"] = child(args, "logits")[0]
    print_result(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def computed(base: str) -> str:
    """The dtype a base stored as `base` is computed in."""
    return "bf16" if base == "bf16" else "fp32"


def measured_run(ours: dict, rss: int, compute: float, rate: float) -> dict:
    """A run's steps, each bounded by max(the in-memory step, its bytes read / fio's read rate)."""
    for s in ours["steps"]:
        s["bound_s"] = max(compute, s["read"] / rate)
        s["vs_bound"] = s["s"] / s["bound_s"] if s["bound_s"] else None  # nothing read, no in-memory step
    measured = [s["vs_bound"] for s in ours["steps"][1:] or ours["steps"] if s["vs_bound"] is not None]
    return {**ours, "peak_rss_bytes": rss, "median_vs_bound": statistics.median(measured) if measured else None}


def print_result(r: dict) -> None:
    fio = r["fio_read_gbps"]
    print(f"fio read on the nvme_path: {fio['before']:.2f} GB/s before, {fio['after']:.2f} GB/s after "
          f"(its buffers: {PAGES[r['fio_memory']]})")
    for compute, seconds in r["in_memory_step_s"].items():
        print(f"in memory (plain PyTorch, {compute}): {seconds:.2f} s/step, peak RSS "
              f"{r['in_memory_peak_rss_bytes'][compute] / GiB:.2f} GiB")
    for name, run in r["runs"].items():
        print_run(name, run)
    if "int8_logits" in r:
        q = r["int8_logits"]
        b = q["bf16_against_fp32"]
        print(f"logits of {q['tokens']} tokens, max |diff| / max |logit| and mean |diff| / mean |logit|: int8 base "
              f"against bf16 base {q['max_relative']:.2e}, {q['mean_relative']:.2e}; bf16 base against fp32 base "
              f"{b['max_relative']:.2e}, {b['mean_relative']:.2e}")


def print_run(name: str, r: dict) -> None:
    print(f"ours ({name} base): base (frozen) {r['frozen_bytes'] / GiB:.2f} GiB on nvme, {r['trained_params']:,} trained "
          f"parameters; host budget {r['host_budget'] / GiB:.2f} GiB (peak {r['host_peak'] / GiB:.2f}), device tier "
          f"peak {r['device_peak'] / GiB:.2f} GiB, peak RSS {r['peak_rss_bytes'] / GiB:.2f} GiB; built in "
          f"{r['build_s']:.0f} s")
    print(f"{'step':>4} {'s':>7} {'stall s':>7} {'read MB':>9} {'frozen MB':>9} {'written MB':>10} {'frozen written':>14} "
          f"{'bound s':>8} {'x bound':>8} {'loss':>8}")
    for s in r["steps"]:
        print(f"{s['step']:>4} {s['s']:7.2f} {s['stall_s']:7.2f} {s['read'] / 1e6:9.1f} {s['frozen_read'] / 1e6:9.1f} "
              f"{s['written'] / 1e6:10.1f} {s['frozen_written']:>14} {s['bound_s']:8.2f} {s['vs_bound'] or 0:8.2f} "
              f"{s['loss']:8.4f}")
    if r["median_vs_bound"] is not None:
        print(f"median step / max(in-memory step, bytes read / fio read), after the first: {r['median_vs_bound']:.2f}x")


ROLES = {"ours": run_ours, "in-memory": run_in_memory, "logits": run_logits}

if __name__ == "__main__":
    main()
