"""Inference from the tiers against its bound: a GPT-2 shaped model saved with save_pretrained, generated from
greedily by plain transformers in memory, by zero.init_inference with the weights in host memory, and with the
weights on nvme under a host budget a quarter of their size (16 MiB at least, and never below the engine's minimum,
zero.inference.engine.host_need: GPT-2's tied embedding is one unit, 154 MB at 124M). Each system runs in its own
process (its peak RSS is its own); the tokens must be the same.

    python bench/infer.py [--quick] [--layers 12] [--hidden 768] [--new-tokens 16] [--json PATH]

Per system: prefill seconds (a 32-token prompt), decode tokens/s (the median interval between new tokens), peak
RSS, nvme bytes read per decoded token. The bounds are measured in the same run: host memory, the weight bytes a
forward copies (read and written once) over the machine's copy rate; nvme, the bytes a token reads over the
disk's read rate (`zero.report`'s measurement through our NvmeStore, on the same directory, just before and
just after the nvme system runs: the bound uses their mean, as the disk drifts).

Without CUDA, the "device" the copies land in is host memory too, so the copy and the forward's own reads of the
weights share one memory bus; a second yardstick for weights in host memory says what that allows: the copy at
the copy rate and the in-memory forward at its measured rate, one after the other (each alone runs at about the
bus's rate, so running them together cannot take less than the sum). On a GPU the copy crosses PCIe while the
forward reads device memory, and the copy bound alone is the yardstick.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from load import vm_hwm  # noqa: E402  (bench/ is the script's directory)
from zero.inference.__main__ import Clock  # noqa: E402

SYSTEMS = ("torch", "ours-cpu", "ours-nvme")


def child(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    prompt = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(0))
    engine = None
    if args.child == "torch":
        model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    else:
        import zero

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
        offload = {"device": "nvme", "nvme_path": args.nvme} if args.child == "ours-nvme" else {"device": "cpu"}
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
            "stage": 3, "offload_param": offload, "stage3_param_persistence_threshold": 0}}
        if args.child == "ours-nvme":
            from zero.inference.engine import host_need

            config["zero_tiering"] = {"host_budget": max(args.host_budget, host_need(model, config))}
        engine = model = zero.init_inference(model, config, weights=args.model)
    clock = Clock()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                             do_sample=False, pad_token_id=0, streamer=clock)
    intervals = [b - a for a, b in zip(clock.times[1:], clock.times[2:])]
    read = engine.swap.stats.bytes_moved.get("nvme->host", 0) if engine is not None else 0
    if engine is not None:
        engine.close()
    return {"system": args.child, "prefill_s": clock.times[1] - start, "decode_tok_s": 1 / statistics.median(intervals),
            "peak_rss": vm_hwm(), "host_budget": engine.swap.pool.budget if engine is not None else None,
            "nvme_read_per_token": read / max(1, args.new_tokens), "tokens": out[0, 32:].tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model, seconds (what the tests run)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the model and the nvme tier go")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--nvme", help=argparse.SUPPRESS)
    parser.add_argument("--host-budget", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    if args.quick:
        args.layers, args.hidden, args.new_tokens = 2, 64, 6
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from zero.plan.machine import memory_rates
    from zero.report.bandwidth import measure

    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        torch.manual_seed(0)
        config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=max(1, args.hidden // 64),
                            vocab_size=50257 if not args.quick else 1024, n_positions=128)
        GPT2LMHeadModel(config).save_pretrained(os.path.join(work, "model"))
        weights = os.path.getsize(os.path.join(work, "model", "model.safetensors"))
        nvme = os.path.join(work, "nvme")
        os.makedirs(nvme)
        probe = max(64 << 20, min(512 << 20, weights // 4096 * 4096))
        copy_rate = memory_rates()[0]
        records = []
        disk_before = disk_after = None
        for system in SYSTEMS:
            if system == "ours-nvme":
                disk_before = measure(nvme, probe).read_gbps
            done = subprocess.run([sys.executable, __file__, "--child", system, "--model", os.path.join(work, "model"),
                                   "--nvme", nvme, "--host-budget", str(max(weights // 4, 16 << 20)),
                                   "--threads", str(args.threads),
                                   "--new-tokens", str(args.new_tokens)], capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{system} failed:\n{done.stderr[-3000:]}")
            records.append(json.loads(done.stdout.strip().splitlines()[-1]))
            if system == "ours-nvme":
                disk_after = measure(nvme, probe).read_gbps
        disk_gbps = (disk_before + disk_after) / 2
    same = all(r["tokens"] == records[0]["tokens"] for r in records)
    memory_bound = copy_rate / (2 * weights)
    in_memory = next(r["decode_tok_s"] for r in records if r["system"] == "torch")
    bus_bound = 1 / (1 / memory_bound + 1 / in_memory)
    print(f"model: {weights / 1e6:.0f} MB of fp32 weights; copy {copy_rate / 1e9:.1f} GB/s (read + written), disk "
          f"read {disk_before:.2f} GB/s before the nvme run, {disk_after:.2f} after; tokens identical: {same}")
    print(f"{'system':<10} {'prefill s':>10} {'decode tok/s':>13} {'bound tok/s':>12} {'of bound':>9} "
          f"{'peak RSS MB':>12}")
    for r in records:
        bound = None
        if r["system"] == "ours-cpu":
            bound = memory_bound
            r["bus_bound_tok_s"] = bus_bound
        elif r["system"] == "ours-nvme" and r["nvme_read_per_token"]:
            bound = disk_gbps * 1e9 / r["nvme_read_per_token"]
        r["bound_tok_s"] = bound
        shown = f"{bound:12.2f} {r['decode_tok_s'] / bound:9.2f}" if bound else f"{'':>12} {'':>9}"
        print(f"{r['system']:<10} {r['prefill_s']:10.3f} {r['decode_tok_s']:13.2f} {shown} {r['peak_rss'] / 1e6:12.0f}")
    budget = next(r["host_budget"] for r in records if r["system"] == "ours-nvme")
    print(f"ours-nvme's host budget: {budget / 1e6:.0f} MB")
    ours = next(r for r in records if r["system"] == "ours-cpu")
    print(f"weights in host memory, copy and forward on one memory bus: bound {bus_bound:.2f} tokens/s (the copy "
          f"at {memory_bound:.2f}, then the in-memory forward at {in_memory:.2f}); ours "
          f"{ours['decode_tok_s'] / bus_bound:.2f} of it")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"weights_bytes": weights, "copy_bytes_per_s": copy_rate, "disk_read_gbps": {"before": disk_before, "after": disk_after},
                       "tokens_identical": same, "records": records}, f, indent=1)
    if not same:
        sys.exit("the systems generated different tokens")


if __name__ == "__main__":
    main()
